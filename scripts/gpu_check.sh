#!/usr/bin/env bash
# The fast-path acceptance check on a CUDA machine (see titanloop/gpu_check.py): a PASS/FAIL table, exit 0 only
# if every check passes. Without CUDA: one line, exit 1. PYTHON=/path/to/python picks the interpreter.
set -euo pipefail
exec "${PYTHON:-python}" -m titanloop.gpu_check "$@"
