"""End-to-end trainer runs with real torchrun (2 gloo processes): NaN handling and W&B offline logging."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DEBUG = str(REPO / "train_configs" / "debug.toml")
FAKE_KEY = "0123456789abcdef0123456789abcdef01234567"  # 40 hex chars, the shape of a real W&B key
TINY = ["--training.seq_len", "32", "--training.micro_batch_size", "2", "--training.global_batch_size", "4",
        "--metrics.log_freq", "1"]

pytestmark = pytest.mark.slow


def train(run_dir: Path, *overrides: str, timeout: int = 180) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline", WANDB_API_KEY=FAKE_KEY, PYTHONUNBUFFERED="1",
               WANDB_SILENT="true")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "titanloop.train", "--config", DEBUG, *TINY, "--training.run_dir", str(run_dir), *overrides]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def records(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_nan_handling_and_wandb_offline_run_without_secrets(tmp_path):
    """The last rank's loss is NaN at step 2: every rank skips that step (no hang), training goes on.
    The same run logs to W&B offline (WANDB_MODE=offline overrides metrics.wandb=online) with a stable run
    id; the fake API key appears nowhere in the run directory or the output."""
    run_dir = tmp_path / "run"
    proc = train(run_dir, "--training.steps", "4", "--training.inject_nan_steps", "[2]", "--metrics.wandb", "online")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "step     2 | non-finite loss (nan) on at least one rank: step skipped (1 in a row" in proc.stdout
    logged = {r["step"]: r for r in records(run_dir)}
    assert sorted(logged) == [1, 3, 4] and logged[4]["skipped_steps"] == 1
    assert all(map(lambda r: r["loss"] == r["loss"], logged.values()))  # finite after the skip

    run_id = (run_dir / "wandb_run_id").read_text().strip()
    offline = list((run_dir / "wandb").glob(f"offline-run-*-{run_id}"))
    assert offline and list(offline[0].glob("*.wandb")), list((run_dir / "wandb").iterdir())
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert FAKE_KEY.encode() not in path.read_bytes(), f"W&B key leaked into {path}"
    assert FAKE_KEY not in proc.stdout + proc.stderr

    # A resumed job (same run_dir) reuses the run id; this one gets NaN at steps 2 and 3 and must stop
    # on every rank after max_nan_steps=2 in a row, with a one-line error and a nonzero exit.
    again = train(run_dir, "--training.steps", "10", "--training.inject_nan_steps", "[2, 3]",
                  "--training.max_nan_steps", "2", "--metrics.wandb", "online")
    assert again.returncode != 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "error: stopped at step 3 after 2 non-finite losses in a row (training.max_nan_steps=2)" in again.stderr
    assert "step     4" not in again.stdout
    assert (run_dir / "wandb_run_id").read_text().strip() == run_id
    assert len(list((run_dir / "wandb").glob(f"offline-run-*-{run_id}"))) == 2
