"""The memory plan (titanloop.train.memory_plan, measured on fake tensors in the dry run) against the peak memory
of a real CPU run of the same step at 1 and 2 gloo ranks (FSDP2, and dp 1 x tp 2): within +-15%.

The real peak is the process's resident-set high-water mark (VmHWM, reset before the model is built) minus the
resident set at that moment: what the operating system saw, not a tensor count. glibc is told to serve every
allocation above 64 KiB with mmap (MALLOC_MMAP_THRESHOLD_), so freed tensors leave the resident set at once."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "train_configs" / "debug.toml"
OVERRIDES = ["--model.hidden_size", "256", "--model.ffn_hidden_size", "704", "--model.vocab_size", "8192",
             "--training.seq_len", "512", "--training.micro_batch_size", "2", "--training.doc_masking", "false",
             "--training.dtype", "float32", "--parallelism.activation_checkpoint", "none"]


def _status(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.M).group(1)) * 1024


def _overrides(world: int, tp: int) -> list[str]:
    return OVERRIDES + ["--training.global_batch_size", str(4 * world // tp), "--parallelism.tp", str(tp)]


def _worker(out: str, tp: int) -> None:
    """A torchrun rank: the trainer's mesh, then one real optimizer step (2 micro-batches) of the plan's code."""
    from titanloop.train.config import load_config
    from titanloop.train.memory_plan import measure_step
    from titanloop.train.startup import init_mesh

    world = int(os.environ["WORLD_SIZE"])
    cfg = load_config(CONFIG, _overrides(world, tp), world_size=world)
    mesh = init_mesh(cfg)
    base = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident set
    tracked = measure_step(cfg, mesh, torch.float32, micro_batches=2, fake=False)
    measured = _status("VmHWM") - base
    if mesh.rank == 0:
        Path(out).write_text(json.dumps({"measured": measured, "tracked": tracked["Total"]}))


def _plan(world: int, tp: int) -> float:
    """Peak bytes of the dry run's memory plan (fake backend, in this process)."""
    from titanloop.train.config import load_config
    from titanloop.train.dry_run import dry_run

    cfg = load_config(CONFIG, _overrides(world, tp), world_size=world)
    report = dry_run(cfg, world, memory_plan=True)
    assert "peak" in report.text()
    return report.memory_plan.peak


@pytest.mark.parametrize("world,tp", [(1, 1), (2, 1), (2, 2)])  # (2, 2): tensor parallel, dp 1 x tp 2
def test_plan_matches_measured_peak(world, tp, tmp_path):
    out = tmp_path / "peak.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
                           __file__, str(out), str(tp)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    real = json.loads(out.read_text())
    plan = _plan(world, tp)
    print(f"world {world}, tp {tp}: plan {plan / 1e6:.0f} MB, measured RSS peak {real['measured'] / 1e6:.0f} MB, "
          f"tracked on real tensors {real['tracked'] / 1e6:.0f} MB")
    assert abs(plan - real["measured"]) <= 0.15 * real["measured"], (plan, real)


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]))
