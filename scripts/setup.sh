#!/usr/bin/env bash
# Create .venv (if missing) and install titanloop with its pinned dependencies. Idempotent.
# TITANLOOP_VENV overrides the location. pip takes torch 2.14.1 / torchvision 0.29.1 from the local disk
# cache when present, otherwise from PyPI (CUDA build, runs on CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${TITANLOOP_VENV:-.venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating virtualenv $VENV"
  "$PY" -m venv "$VENV"
fi
stamp="$VENV/.titanloop-installed"
want="$(cat pyproject.toml | sha1sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "[setup] $VENV is up to date"
else
  echo "[setup] installing titanloop and pinned dependencies into $VENV (first time: several minutes, ~6 GB)"
  "$VENV/bin/pip" install --quiet --disable-pip-version-check -e '.[test]' 2> >(grep -v "^WARNING: Location" >&2)
  echo "$want" > "$stamp"
fi
