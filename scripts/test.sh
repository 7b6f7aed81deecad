#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite, slow end-to-end tests included.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not slow"` for the quick subset.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export WANDB_MODE=offline WANDB_SILENT=true HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "${TITANLOOP_VENV:-.venv}/bin/python" -m pytest -q "$@"
