"""End to end: real torchrun runs of tests/checkpoint_tinytrain_driver.py, interrupted by real signals.

- bitwise resume: 2 ranks interrupted by SIGUSR1 (to the workers, as slurm/launch_node.sh forwards it),
  SIGTERM (to torchrun, which forwards it) and SIGKILL (everything; falls back to the last periodic save),
  resumed each time; weights, optimizer state and loss history equal an uninterrupted run bit for bit.
- SIGKILL while a checkpoint is being written: the next start resumes from the previous complete one.
- world-size change: saved on 2 ranks, resumed on 1 and on 4.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
from pathlib import Path

import pytest
import torch

from launch import REPO, Launch, next_log

pytestmark = pytest.mark.slow
DRIVER = REPO / "tests" / "checkpoint_tinytrain_driver.py"


class Run(Launch):
    """One torchrun launch of the driver; its output goes to <run_dir>/launch-<n>.log."""

    def __init__(self, run_dir: Path, *args, nproc: int = 2):
        driver_args = ["--run-dir", str(run_dir), *map(str, args)]
        super().__init__(nproc, str(DRIVER), *driver_args, log=next_log(run_dir), run_dir=run_dir)

    def wait_step(self, step: int, timeout: float = 180) -> int:
        progress = self.run_dir / "progress"

        def reached() -> int | None:
            text = progress.read_text().strip() if progress.exists() else ""  # read once: the driver rewrites it
            return int(text) if text.isdigit() and int(text) >= step else None

        return self.wait_until(reached, f"step {step}", timeout)

    def resumed_from(self) -> int | None:
        line = next(ln for ln in self.out.splitlines() if ln.startswith("start step="))
        value = line.split("resumed_from=")[1].split()[0]
        return None if value == "None" else int(value)

    def preempted_at(self) -> int:
        line = next(ln for ln in self.out.splitlines() if ln.startswith("preempted at step"))
        return int(line.split()[3])


def latest(run_dir: Path) -> int:
    return int((run_dir / "checkpoints" / "latest").read_text().strip().split("-")[1])


def final_state(run_dir: Path) -> dict:
    return torch.load(run_dir / "final.pt", weights_only=True)


def assert_identical(a: dict, b: dict) -> None:
    assert a["losses"] == b["losses"]
    assert a["lr"] == b["lr"]
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), k
    assert a["optimizer"].keys() == b["optimizer"].keys()
    for k, v in a["optimizer"].items():
        assert torch.equal(v, b["optimizer"][k]) if torch.is_tensor(v) else v == b["optimizer"][k], k


STEPS, INTERVAL = 14, 3
COMMON = ("--steps", STEPS, "--interval", INTERVAL, "--keep-last", 2, "--sleep", 0.2)


def test_bitwise_resume_after_usr1_term_and_kill(tmp_path):
    rng = random.Random(os.getpid())
    reference = Run(tmp_path / "uninterrupted", *COMMON)
    assert reference.finish() == 0, reference.out[-3000:]

    run_dir = tmp_path / "interrupted"
    events = []
    # 1. SIGUSR1 to the workers (what slurm/launch_node.sh does with the forwarded Slurm signal)
    run = Run(run_dir, *COMMON)
    run.wait_step(rng.randint(2, 4))
    run.signal_workers(signal.SIGUSR1)
    assert run.finish() != 0  # 75 from the workers, 1 from torchrun: "not finished, start me again"
    stop = run.preempted_at()
    assert latest(run_dir) == stop
    events.append(("SIGUSR1", stop))
    # 2. SIGTERM to torchrun: it forwards SIGTERM to the workers and waits for them (30 s before SIGKILL)
    run = Run(run_dir, *COMMON)
    run.wait_step(stop + rng.randint(2, 3))
    run.proc.send_signal(signal.SIGTERM)
    run.finish()
    assert run.resumed_from() == stop
    stop = run.preempted_at()
    assert latest(run_dir) == stop
    events.append(("SIGTERM", stop))
    # 3. SIGKILL everything: no chance to save; resume from the newest periodic checkpoint
    run = Run(run_dir, *COMMON)
    killed_at = run.wait_step(stop + rng.randint(3, 4))
    run.kill()
    assert run.resumed_from() == stop
    fallback = latest(run_dir)
    assert fallback <= killed_at and fallback >= killed_at - INTERVAL
    events.append(("SIGKILL", killed_at))
    # 4. run to the end
    run = Run(run_dir, *COMMON)
    assert run.finish() == 0, run.out[-3000:]
    assert run.resumed_from() == fallback
    assert_identical(final_state(run_dir), final_state(tmp_path / "uninterrupted"))
    n_ckpt = sum(
        1 for ln in "".join(p.read_text() for p in run_dir.glob("launch-*.log")).splitlines() if "published" in ln
    )
    assert n_ckpt >= 6  # periodic saves + the two preemption saves + the final save
    print(
        f"interruptions {events}; {n_ckpt} checkpoints published; resumed from {fallback} after SIGKILL; "
        "final state identical to the uninterrupted run"
    )


def test_sigkill_during_save_resumes_from_previous_checkpoint(tmp_path):
    args = ("--steps", 6, "--interval", 2, "--hidden", 384, "--vocab", 4096)
    run = Run(tmp_path, *args)
    staging = tmp_path / "checkpoints" / ".staging-step-00000004"
    run.wait_until(staging.exists, "the save of step 4", 240, poll=0.002)
    run.kill()  # mid-write of step 4
    assert latest(tmp_path) == 2, "the kill came too late: step 4 was already published"
    assert staging.exists()
    run = Run(tmp_path, *args)
    assert run.finish() == 0, run.out[-3000:]
    assert run.resumed_from() == 2  # never the partial step 4
    assert not staging.exists()
    assert latest(tmp_path) == 6


def test_world_size_change_2_to_1_and_4(tmp_path):
    base = tmp_path / "w2"
    run = Run(base, "--steps", 6, "--interval", 3)
    assert run.finish() == 0, run.out[-3000:]
    manifest = json.loads((base / "checkpoints" / "step-00000006" / "titanloop.json").read_text())
    assert manifest["world_size"] == 2
    finals = {}
    for world in (1, 4):
        run_dir = tmp_path / f"resume-w{world}"
        shutil.copytree(base, run_dir)
        (run_dir / "final.pt").unlink()
        run = Run(run_dir, "--steps", 9, "--interval", 3, nproc=world)
        assert run.finish() == 0, run.out[-3000:]
        assert run.resumed_from() == 6 and f"world={world}" in run.out
        finals[world] = final_state(run_dir)
    saved = final_state(base)["losses"]
    one, four = finals[1], finals[4]
    assert one["losses"][:6] == four["losses"][:6] == saved  # history restored exactly on both
    # steps 7-9 ran on 1 and on 4 ranks from the same resharded state and data position: equal up to the
    # reduction order of the gradient all-reduce
    assert four["losses"][6:] == pytest.approx(one["losses"][6:], rel=1e-4)
    for k, v in one["model"].items():
        torch.testing.assert_close(four["model"][k], v, rtol=1e-4, atol=1e-5)
