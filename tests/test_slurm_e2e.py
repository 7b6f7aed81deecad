"""Slurm end to end on the local cluster (slurm/local_cluster.sh): sbatch slurm/stage1a.sh with a tiny CPU
run, preempted with `scancel -s USR1 -b` (what --signal=B:USR1@margin does before the time limit): the
batch shell forwards the signal, the ranks save and exit, the job requeues itself, resumes from the
checkpoint (SLURM_RESTART_COUNT=1) and completes; its final checkpoint equals an uninterrupted job's bit
for bit. Skipped only when no Slurm cluster answers (`sinfo`); CI starts one with slurm/local_cluster.sh.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from titanloop.checkpoint.safe_reader import SafeFileSystemReader, read_dcp_metadata

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


def _cluster_problem() -> str | None:
    if shutil.which("sinfo") is None or shutil.which("sbatch") is None:
        return "Slurm is not installed (start one with `sudo bash slurm/local_cluster.sh install start`)"
    r = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True)
    if r.returncode != 0:
        return f"no Slurm controller answers sinfo ({r.stderr.strip()[:200]}); run slurm/local_cluster.sh start"
    if not any(s in r.stdout for s in ("idle", "mixed")):
        return f"no idle Slurm node (sinfo: {r.stdout.split()})"
    return None


def sbatch(run_dir: Path, steps: int) -> str:
    run_dir.mkdir(parents=True)
    env = {**os.environ, "CPU": "1", "NPROC": "2", "TITANLOOP_TRAIN": "tests/test_checkpoint_tinytrain.py",
           "TITANLOOP_CONFIG": "train_configs/debug.toml", "TITANLOOP_RESIGNAL_S": "5"}
    cmd = ["sbatch", "--parsable", "--nodes=1", "--gres=none", "--cpus-per-task=1", "--mem=2G", "--time=30",
           "--signal=B:USR1@10", f"--output={run_dir}/slurm.out", "slurm/stage1a.sh",
           "--run-dir", str(run_dir), "--steps", str(steps), "--interval", "3", "--sleep", "0.3"]
    return subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, text=True).stdout.strip()


def job_state(job: str) -> dict:
    out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, check=True).stdout
    return dict(re.findall(r"(\w+)=(\S+)", out))


def wait_done(job: str, run_dir: Path, timeout: float = 300) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        state = job_state(job)
        if state["JobState"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            return state
        time.sleep(1)
    subprocess.run(["scancel", job])
    raise AssertionError(f"job {job} not done in {timeout}s:\n{(run_dir / 'slurm.out').read_text()[-3000:]}")


def checkpoint_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a published checkpoint (model, optimizer, RNG of every rank, ...)."""
    md = read_dcp_metadata(ckpt / ".metadata").state_dict_metadata
    out = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in md.items()}
    dcp.load(out, storage_reader=SafeFileSystemReader(ckpt), no_dist=True)
    return out


def test_sbatch_preempted_requeued_resumed_equals_uninterrupted(tmp_path):
    problem = _cluster_problem()
    if problem:
        pytest.skip(problem)
    steps = 14
    ref_dir, run_dir = tmp_path / "uninterrupted", tmp_path / "preempted"
    ref_job, job = sbatch(ref_dir, steps), sbatch(run_dir, steps)
    progress = run_dir / "progress"
    deadline = time.time() + 180
    while not (progress.exists() and progress.read_text().strip().isdigit() and int(progress.read_text()) >= 4):
        assert time.time() < deadline and job_state(job)["JobState"] in ("PENDING", "RUNNING"), \
            (run_dir / "slurm.out").read_text()[-3000:] if (run_dir / "slurm.out").exists() else job_state(job)
        time.sleep(0.2)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True)

    final = wait_done(job, run_dir)
    log = (run_dir / "slurm.out").read_text()
    assert final["JobState"] == "COMPLETED", log[-3000:]
    assert final["Restarts"] == "1", log[-3000:]  # requeued exactly once
    stop = int(re.search(r"preempted at step (\d+)", log).group(1))
    assert f"start step={stop} resumed_from={stop}" in log and "restart 1:" in log and "requeueing" in log
    assert wait_done(ref_job, ref_dir)["JobState"] == "COMPLETED", (ref_dir / "slurm.out").read_text()[-3000:]

    ref = torch.load(ref_dir / "final.pt", weights_only=True)
    got = torch.load(run_dir / "final.pt", weights_only=True)
    assert got["losses"] == ref["losses"]
    for k, v in ref["model"].items():
        assert torch.equal(v, got["model"][k]), k
    # the final checkpoints agree tensor by tensor (model, optimizer, per-rank RNG) and in their JSON state
    last = f"checkpoints/step-{steps:08d}"
    a, b = checkpoint_tensors(ref_dir / last), checkpoint_tensors(run_dir / last)
    assert a.keys() == b.keys()
    for k in a:  # bitwise (NaN marks "no cached gaussian" in the Python RNG state)
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, equal_nan=True, msg=k)
    ma, mb = (json.loads((d / last / "titanloop.json").read_text())["states"] for d in (ref_dir, run_dir))
    assert ma == mb
    print(f"slurm: preempted at step {stop}, requeued once, resumed and completed; identical to uninterrupted")
