"""The checkpoint object torchtitan's Trainer.train drives, built from titanloop's Checkpointer.

torchtitan's loop calls `checkpointer.load(step=...)` once, `checkpointer.save(step, last_step=...)` after
every step and `checkpointer.close()` at the end. This adapter maps those calls onto the atomic
Checkpointer and adds the preemption protocol at the same step boundary:

    load            -> Checkpointer.load_latest()       (auto-resume from the run dir, no flag)
    save(step)      -> maybe_save(step); the final step is saved synchronously;
                       then PreemptionMonitor.should_stop(step): if any rank was signalled, every rank saves
                       synchronously and raises Preempted (SystemExit with code 75).
"""

from __future__ import annotations

from titanloop.checkpoint.checkpointer import Checkpointer
from titanloop.checkpoint.preemption import EXIT_CODE_PREEMPTED, PreemptionMonitor


class Preempted(SystemExit):
    """Raised on every rank after the preemption save; the process exits with EXIT_CODE_PREEMPTED."""

    def __init__(self, step: int):
        super().__init__(EXIT_CODE_PREEMPTED)
        self.step = step


class TrainerCheckpointer:
    def __init__(self, checkpointer: Checkpointer, monitor: PreemptionMonitor | None):
        self.checkpointer, self.monitor = checkpointer, monitor

    def load(self, step: int = -1) -> bool:
        """Resume from the newest complete checkpoint in the run dir (torchtitan's load_step is ignored)."""
        return self.checkpointer.load_latest() is not None

    def save(self, curr_step: int, last_step: bool = False) -> None:
        ckpt = self.checkpointer
        ckpt.maybe_save(curr_step)
        if last_step and ckpt.last_saved_step != curr_step:
            ckpt.save(curr_step, sync=True)
        if self.monitor is not None and self.monitor.should_stop(curr_step):
            if ckpt.last_saved_step != curr_step:
                ckpt.save(curr_step, sync=True)
            ckpt.wait()
            if ckpt.rank == 0:
                saved = "checkpoint saved" if ckpt.cfg.enable else "checkpointing is disabled, nothing saved"
                print(f"[titanloop] preempted at step {curr_step} ({self.monitor.reason}): {saved}, "
                      f"exiting with code {EXIT_CODE_PREEMPTED} so the job is requeued", flush=True)
            raise Preempted(curr_step)

    def close(self) -> None:
        self.checkpointer.close()
