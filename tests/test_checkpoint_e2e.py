"""End to end: real torchrun runs of tests/checkpoint_tinytrain_driver.py, a training loop of its own around the
checkpointer.

- world-size change: saved on 2 ranks, resumed on 1 and on 4.

Bitwise resume after SIGUSR1, SIGTERM and a SIGKILL during a save is tested through the real trainer
(`torchrun -m titanloop.train`) in tests/test_train_preemption.py, and under Slurm in tests/test_slurm_e2e.py;
the driver's own versions of those two tests were removed as duplicates."""

from __future__ import annotations

import json
import shutil
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

    def resumed_from(self) -> int | None:
        line = next(ln for ln in self.out.splitlines() if ln.startswith("start step="))
        value = line.split("resumed_from=")[1].split()[0]
        return None if value == "None" else int(value)


def final_state(run_dir: Path) -> dict:
    return torch.load(run_dir / "final.pt", weights_only=True)


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
