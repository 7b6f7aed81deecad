"""Preemption signals -> one agreed step boundary at which every rank saves and exits.

Protocol (docs/checkpointing.md):
  1. SIGUSR1 / SIGTERM (configurable) reaching any rank only sets a flag (the handler does no I/O). Later
     signals, e.g. a second SIGTERM during the save, are recorded and otherwise ignored: the handler stays
     installed, so they cannot kill the process half-way through a save.
  2. At every step boundary `should_stop(step)` all-reduces the flag (MAX over ranks, one int): all ranks
     see the same answer at the same step, even if the signal reached only some of them.
  3. The trainer then saves synchronously and exits with EXIT_CODE_PREEMPTED (75, EX_TEMPFAIL: "try again").
     The requeue itself is done by the sbatch script (slurm/common.sh), which knows it was signalled and calls
     `scontrol requeue`: Slurm never requeues a job by its exit code on its own (a time-limit signal or a
     manual `scancel -s USR1` leads to COMPLETED/FAILED), and torchrun maps any worker exit code to 1 anyway.
Optionally the job also stops by itself when the remaining Slurm time drops below `slurm_time_margin_s`.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from datetime import datetime

import torch
import torch.distributed as dist

from titanloop.config_errors import ConfigError

log = logging.getLogger("titanloop.checkpoint")

EXIT_CODE_PREEMPTED = 75  # EX_TEMPFAIL: the run is not finished, start it again with the same run dir


def collective_device() -> torch.device:
    """Where small control tensors must live for the default group's backend (NCCL: the GPU)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _parse_signal(name) -> signal.Signals:
    if isinstance(name, int):
        return signal.Signals(name)
    key = str(name).upper()
    key = key if key.startswith("SIG") else "SIG" + key
    if key not in signal.Signals.__members__ or key in ("SIGKILL", "SIGSTOP"):
        raise ConfigError(
            f"preemption signal {name!r} is invalid: expected a catchable signal name such as 'SIGUSR1' or 'SIGTERM'"
        )
    return signal.Signals[key]


def slurm_job_end_time() -> float | None:
    """Epoch seconds at which Slurm ends this job (SLURM_JOB_END_TIME, else `squeue -o %e`), None outside Slurm."""
    if os.environ.get("SLURM_JOB_END_TIME", "").isdigit():
        return float(os.environ["SLURM_JOB_END_TIME"])
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return None
    try:
        out = subprocess.run(
            ["squeue", "-h", "-j", job, "-o", "%e"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        return datetime.fromisoformat(out).timestamp()
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


class PreemptionMonitor:
    def __init__(self, signals=("SIGUSR1", "SIGTERM"), slurm_time_margin_s: float = 0.0, install: bool = True):
        self.signals = [_parse_signal(s) for s in signals]
        self.margin = float(slurm_time_margin_s)
        self.received: list[signal.Signals] = []  # every signal seen, in order
        self.reason: str | None = None  # why should_stop() said yes
        self._end_time = slurm_job_end_time() if self.margin > 0 else None
        if install:
            for s in self.signals:
                signal.signal(s, self._handle)

    def _handle(self, signum, frame) -> None:
        self.received.append(signal.Signals(signum))

    @property
    def signalled(self) -> bool:
        return bool(self.received)

    def _local_reason(self) -> int:
        if self.received:
            return 1
        if self._end_time is not None and self._end_time - time.time() < self.margin:
            return 2
        return 0

    def should_stop(self, step: int) -> bool:
        """True on every rank once any rank got a preemption signal (or Slurm time runs out); collective."""
        code = self._local_reason()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            t = torch.tensor([code], dtype=torch.int32, device=collective_device())
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            code = int(t.item())
        if code and self.reason is None:
            self.reason = (
                "signal " + (self.received[0].name if self.received else "on another rank")
                if code == 1
                else f"less than {self.margin:.0f}s of Slurm time left"
            )
            log.warning(
                "preemption at step %d (%s): saving and exiting with code %d", step, self.reason, EXIT_CODE_PREEMPTED
            )
        return bool(code)
