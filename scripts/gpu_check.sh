#!/usr/bin/env bash
# The acceptance check of a GPU node (`python -m titanloop.checks`): a PASS/FAIL table and a json (--out).
#
#   bash scripts/gpu_check.sh [options of python -m titanloop.checks]       # the project's .venv, set up if needed
#   bash scripts/gpu_check.sh --python /usr/bin/python3 [options]          # an interpreter that already has torch,
#   PYTHON=/usr/bin/python3 bash scripts/gpu_check.sh [options]            #   torchtitan and torchao: nothing installed
#
# With the .venv (TITANLOOP_VENV overrides its location) it runs scripts/setup.sh first and, on a CUDA machine,
# tries the optional GPU extra (flash-attn) once per venv, giving up after TITANLOOP_FLASH_ATTN_TIMEOUT seconds
# (default 300) where no prebuilt wheel fits this torch; `--no-gpu-extras` skips that. `--help` prints this header
# and the check's own help, and installs nothing.
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
    PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec "$PY" -m titanloop.checks --help
  fi
  echo "no interpreter with torch here yet: after setup, .venv/bin/python -m titanloop.checks --help"
  exit 0
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" WANDB_MODE="${WANDB_MODE:-offline}"
if [ -n "$PY" ]; then
  if ! "$PY" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("torch") is None)' >/dev/null 2>&1; then
    echo "error: python '$PY' cannot import torch: give an interpreter with torch installed, or leave out" \
         "--python/PYTHON to use the project's .venv" >&2
    exit 2
  fi
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
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's titanloop, whatever the interpreter has
exec "$PY" -m titanloop.checks "${ARGS[@]}"
