"""Slurm end to end on the local cluster (slurm/local_cluster.sh): sbatch slurm/stage1a.sh running the real
trainer (`torchrun -m titanloop.train`) on the tiny CPU config train_configs/debug.toml, preempted with
`scancel -s USR1 -b` (what --signal=B:USR1@margin does before the time limit): the
batch shell forwards the signal, the ranks save and exit, the job requeues itself, resumes from the
checkpoint (SLURM_RESTART_COUNT=1) with the same W&B run id and completes; its final checkpoint (model,
optimizer, LR schedule, data state, counters, per-rank RNG) equals an uninterrupted job's bit for bit.
Skipped only when no Slurm cluster answers (`sinfo`); CI starts one with slurm/local_cluster.sh.
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

from titanloop.checkpoint.safe_reader import read_dcp_entries

from launch import override_args

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


def sbatch(run_dir: Path, steps: int, *sbatch_args: str, wandb: str = "offline") -> str:
    run_dir.mkdir(parents=True)
    env = {
        **os.environ,
        "CPU": "1",
        "NPROC": "2",
        "TITANLOOP_CONFIG": "train_configs/debug.toml",
        "TITANLOOP_RUN_DIR": str(run_dir),
        "TITANLOOP_RESIGNAL_S": "5",
        "WANDB_MODE": "offline",
    }
    cmd = [
        "sbatch",
        "--parsable",
        "--nodes=1",
        "--gres=none",
        "--cpus-per-task=1",
        "--mem=4G",
        "--time=30",
        "--signal=B:USR1@10",
        f"--output={run_dir}/slurm.out",
        *sbatch_args,
        "slurm/stage1a.sh",
        *override_args(
            {
                "training.steps": steps,
                "checkpoint.enable": True,
                "checkpoint.interval": 4,
                "metrics.log_freq": 1,
                "metrics.wandb": wandb,
            }
        ),
    ]
    return subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, text=True).stdout.strip()


def last_step(log: Path) -> int:
    steps = re.findall(r"(?m)^step\s+(\d+) \|", log.read_text()) if log.exists() else []
    return int(steps[-1]) if steps else 0


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
    out = run_dir / "slurm.out"
    raise AssertionError(f"job {job} not done in {timeout}s:\n{out.read_text()[-3000:] if out.exists() else ''}")


def checkpoint_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a published checkpoint (model, optimizer, RNG of every rank, ...)."""
    return read_dcp_entries(ckpt)


def test_sbatch_preempted_requeued_resumed_equals_uninterrupted(tmp_path):
    problem = _cluster_problem()
    if problem:
        pytest.skip(problem)
    steps = 16
    ref_dir, run_dir = tmp_path / "uninterrupted", tmp_path / "preempted"
    ref_job, job = sbatch(ref_dir, steps), sbatch(run_dir, steps)
    deadline = time.time() + 240
    while last_step(run_dir / "slurm.out") < 3:
        assert time.time() < deadline and job_state(job)["JobState"] in ("PENDING", "RUNNING"), (
            (run_dir / "slurm.out").read_text()[-3000:] if (run_dir / "slurm.out").exists() else job_state(job)
        )
        time.sleep(0.2)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True)

    final = wait_done(job, run_dir)
    log = (run_dir / "slurm.out").read_text()
    assert final["JobState"] == "COMPLETED", log[-3000:]
    assert final["Restarts"] == "1", log[-3000:]  # requeued exactly once
    stop = int(re.search(r"preempted at step (\d+)", log).group(1))
    assert stop < steps and "restart 1:" in log and "requeueing" in log
    after_requeue = log[log.index("restart 1:") :]
    assert int(re.search(r"(?m)^step\s+(\d+) \|", after_requeue).group(1)) == stop + 1  # resumed, no replay
    run_ids = re.findall(r"W&B offline run id (\w+)", log)
    assert len(run_ids) == 2 and run_ids[0] == run_ids[1], run_ids  # the requeued job continues the W&B run
    assert wait_done(ref_job, ref_dir)["JobState"] == "COMPLETED", (ref_dir / "slurm.out").read_text()[-3000:]

    # the final checkpoints agree tensor by tensor (model, optimizer, per-rank RNG) and in their JSON state
    last = f"checkpoints/step-{steps:08d}"
    a, b = checkpoint_tensors(ref_dir / last), checkpoint_tensors(run_dir / last)
    assert a.keys() == b.keys()
    # The trainer seeds torch only: Python/NumPy RNG states start from OS entropy in each job, so only
    # those are excluded; everything else (torch RNG of each rank included) must match bit for bit.
    compared = [k for k in a if not re.match(r"rng/rank\d+/(python|numpy)_", k)]
    for k in compared:
        assert torch.equal(a[k], b[k]), k
    ma, mb = (json.loads((d / last / "titanloop.json").read_text()) for d in (ref_dir, run_dir))
    assert ma["states"] == mb["states"] and ma["stage"] == mb["stage"] == "stage1a"
    print(
        f"slurm: preempted at step {stop}, requeued once, resumed at {stop + 1}, completed {steps} steps; "
        f"{len(compared)} tensors + JSON state identical to the uninterrupted job"
    )


def test_partition_preemption_sigterm_save_and_slurm_requeue(tmp_path):
    """A job in the higher-priority `urgent` partition preempts the training job (PreemptMode=REQUEUE):
    Slurm sends SIGTERM to every process, the ranks save at the next step boundary (torchrun gives them
    30 s), Slurm requeues the job by itself, and it resumes from that save and completes."""
    problem = _cluster_problem()
    if problem:
        pytest.skip(problem)
    cpus = subprocess.run(["sinfo", "-h", "-p", "batch", "-o", "%c"], capture_output=True, text=True).stdout.split()
    if not cpus:
        pytest.skip("the cluster has no `batch` partition (start it with slurm/local_cluster.sh)")
    # Enough steps that the job cannot finish before Slurm's scheduler acts on the urgent job: on the loaded 2-core
    # CI machine 20 steps once ran to completion before the preemption arrived.
    steps, run_dir = 48, tmp_path / "run"
    # The whole node, so the urgent job must preempt it. W&B off: Slurm's SIGTERM also reaches the wandb-core
    # service process, which dies, and the trainer's next W&B call fails (see docs/checkpointing.md).
    job = sbatch(run_dir, steps, f"--cpus-per-task={cpus[0]}", wandb="off")
    deadline = time.time() + 240
    while last_step(run_dir / "slurm.out") < 3:
        assert time.time() < deadline and job_state(job)["JobState"] in ("PENDING", "RUNNING"), job_state(job)
        time.sleep(0.2)
    urgent = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "--partition=urgent",
            f"--cpus-per-task={cpus[0]}",
            f"--output={tmp_path}/urgent.out",
            "--wrap",
            "sleep 2",
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    final = wait_done(job, run_dir, timeout=500)
    log = (run_dir / "slurm.out").read_text()
    assert final["JobState"] == "COMPLETED" and final["Restarts"] == "1", (
        f"training job ended {final['JobState']} after {final['Restarts']} restarts (expected one requeue); "
        f"urgent job {job_state(urgent)['JobState']}\n{log[-3000:]}"
    )
    # The requeued job could only start once the urgent job had the node and left it.
    assert wait_done(urgent, tmp_path, timeout=60)["JobState"] == "COMPLETED"
    stop = int(re.search(r"preempted at step (\d+) \(signal SIGTERM\)", log).group(1))
    after_requeue = log[log.index("restart 1:") :]
    assert int(re.search(r"(?m)^step\s+(\d+) \|", after_requeue).group(1)) == stop + 1
    assert (run_dir / "checkpoints" / f"step-{steps:08d}").is_dir()
    print(f"slurm partition preemption: SIGTERM save at step {stop}, requeued by Slurm, resumed at {stop + 1}")
