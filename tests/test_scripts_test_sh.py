"""scripts/test.sh, the README's test command: its own `--help`, before setup."""

from __future__ import annotations

import subprocess
from pathlib import Path

from helpers import no_setup_env

ROOT = Path(__file__).resolve().parent.parent


def test_help_explains_and_runs_no_setup(tmp_path):
    """`test.sh --help` prints its usage and exits 0 without setup: no venv at TITANLOOP_VENV, and a python3
    that cannot make one (the old script went into setup first, on a fresh machine a ~6 GB install, then showed
    pytest's help instead of its own)."""
    env = no_setup_env(tmp_path)
    for flag in ("--help", "-h"):
        proc = subprocess.run(
            ["bash", "scripts/test.sh", "-m", "not slow", flag], cwd=ROOT, env=env, capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith("usage: bash scripts/test.sh [pytest options]")
        assert '-m "not slow"' in proc.stdout and "[setup]" not in proc.stdout
        assert not (tmp_path / "venv").exists()


def test_a_bad_worker_count_is_one_line_before_setup(tmp_path):
    """TITANLOOP_TEST_WORKERS (how many test files run at a time) must be a whole number: anything else is one line
    on stderr and exit 2, before setup creates a venv."""
    env = no_setup_env(tmp_path)
    for bad in ("two", "-1", ""):
        proc = subprocess.run(
            ["bash", "scripts/test.sh"],
            cwd=ROOT,
            env={**env, "TITANLOOP_TEST_WORKERS": bad},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 2, (bad, proc.stdout, proc.stderr)
        assert proc.stderr.splitlines() == [
            f"TITANLOOP_TEST_WORKERS={bad}: give a whole number of test workers (0: none, run in-process)"
        ], proc.stderr
        assert not (tmp_path / "venv").exists()
