#!/usr/bin/env bash
# usage: bash scripts/test.sh [pytest options]
#
# Set up .venv if needed (scripts/setup.sh: titanloop with its pinned dependencies; the first time takes minutes and
# ~6 GB), then run the whole test suite with pytest, slow end-to-end tests included: about 30 minutes on 2 cores.
# Two test files run at a time (pytest-xdist, --dist loadfile: a file's tests share one worker, so a module's
# fixtures run once). TITANLOOP_TEST_WORKERS=N runs N at a time; 0 runs every test in this one process.
# Every other argument goes to pytest, e.g.
#   bash scripts/test.sh -m "not slow"                   # the quick subset
#   bash scripts/test.sh tests/test_train_metrics.py -x   # one file, stop at the first failure
# The Slurm tests need a local cluster (sudo bash slurm/local_cluster.sh install && ... start); under CI=true a
# skipped test fails the run unless it needs a GPU (tests/conftest.py). pytest's own options:
# `.venv/bin/python -m pytest --help` once the venv exists.
set -euo pipefail
cd "$(dirname "$0")/.."
for arg in "$@"; do
  # this script's own help: the header comment above, before setup (nothing is installed)
  case "$arg" in -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;; esac
done
workers="${TITANLOOP_TEST_WORKERS-2}"  # unset: 2; set but empty: an error
case "$workers" in
  ''|*[!0-9]*) echo "TITANLOOP_TEST_WORKERS=$workers: give a whole number of test workers (0: none, run in-process)" >&2; exit 2 ;;
esac
bash scripts/setup.sh
export WANDB_MODE=offline WANDB_SILENT=true HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "${TITANLOOP_VENV:-.venv}/bin/python" -m pytest -q -n "$workers" --dist loadfile "$@"
