#!/usr/bin/env bash
# The fast-path acceptance check on a CUDA machine (scripts/gpu_check.py): a PASS/FAIL table and
# benchmarks/results/gpu_check.json; exit 0 only if every check passes. Without CUDA: one line, exit 1.
#
#   bash scripts/gpu_check.sh [gpu_check options]            # the project's .venv, as demo.sh and test.sh use
#   bash scripts/gpu_check.sh --python /usr/bin/python3 ...  # an existing interpreter with torch (e.g. a GPU
#   PYTHON=/usr/bin/python3 bash scripts/gpu_check.sh ...    #   machine's own torch, no network): nothing installed
#
# With the .venv (TITANLOOP_VENV overrides its location) it runs scripts/setup.sh first and, on a CUDA machine,
# tries the GPU extra (flash-attn) once per venv; flash-attn is optional, and without a prebuilt wheel for this
# torch/CUDA its source build is given up after TITANLOOP_FLASH_ATTN_TIMEOUT seconds (default 300).
# `--no-gpu-extras` skips that. Other options go to `python scripts/gpu_check.py`. `--help` prints this header and,
# where an interpreter with torch is already at hand (--python, or an existing .venv), gpu_check.py's options; it
# installs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
EXTRAS=1
HELP=0
ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --python) PY="${2:-}"; shift 2 || { echo "error: --python needs an interpreter, e.g. --python /usr/bin/python3" >&2; exit 2; }
              [ -n "$PY" ] || { echo "error: --python is empty: give an interpreter, e.g. --python /usr/bin/python3" >&2; exit 2; } ;;
    --python=*) PY="${1#*=}"; shift ;;
    --no-gpu-extras) EXTRAS=0; shift ;;
    -h|--help) HELP=1; shift ;;
    *) ARGS+=("$1"); shift ;;
  esac
done
if [ "$HELP" = 1 ]; then  # before setup: nothing is installed
  sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
  [ -n "$PY" ] || PY="${TITANLOOP_VENV:-.venv}/bin/python"
  echo
  if "$PY" -c 'import torch' >/dev/null 2>&1; then
    PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec "$PY" scripts/gpu_check.py --help
  fi
  echo "gpu_check.py's options: no interpreter with torch here yet; after setup, .venv/bin/python scripts/gpu_check.py --help"
  exit 0
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" WANDB_MODE="${WANDB_MODE:-offline}"
if [ -n "$PY" ]; then
  if ! "$PY" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("torch") is None)' >/dev/null 2>&1; then
    echo "error: python '$PY' cannot import torch: give an interpreter with torch installed, or leave out" \
         "--python/PYTHON to use the project's .venv" >&2
    exit 2
  fi
  # this checkout's titanloop, whatever the interpreter has installed
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  bash scripts/setup.sh
  VENV="${TITANLOOP_VENV:-.venv}"
  PY="$VENV/bin/python"
  tried="$VENV/.titanloop-gpu-extras-tried"
  if [ "$EXTRAS" = 1 ] && [ ! -f "$tried" ] && command -v nvidia-smi >/dev/null 2>&1 \
      && "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1 \
      && ! "$PY" -c 'import flash_attn' >/dev/null 2>&1; then
    echo "[gpu_check] installing the GPU extra flash-attn (optional; at most ${TITANLOOP_FLASH_ATTN_TIMEOUT:-300} s)"
    if timeout "${TITANLOOP_FLASH_ATTN_TIMEOUT:-300}" "$VENV/bin/pip" install --quiet --disable-pip-version-check \
        --no-build-isolation flash-attn; then
      echo "[gpu_check] flash-attn installed"
    else
      echo "[gpu_check] flash-attn not installed (no prebuilt wheel for this torch/CUDA, or no network):" \
           "continuing with torch's attention kernels"
    fi
    touch "$tried"
  fi
fi
exec "$PY" scripts/gpu_check.py "${ARGS[@]}"
