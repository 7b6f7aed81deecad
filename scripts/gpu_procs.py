"""The time budget and process handling shared by the GPU scripts (gpu_session, gpu_check, gpu_eval_check and
benchmarks/gpu_throughput): standard library only, since gpu_session imports it before the wheels are installed.

A GPU session is a few minutes of a lent machine, so every script runs within --budget-s, and nothing it starts may
outlive it: a run left holding the GPU would spoil the next row or part. Each child is started in its own process
group (torchrun and its workers together) and stopped as a group. A script's SIGTERM (gpu_session stopping a part
that overran) becomes SystemExit, so the child group it is waiting on is stopped on the way out; by Python's
default, SIGTERM would end the script at once and leave that group running in its own session.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

STOP_GRACE_S = 30.0  # SIGTERM to a group, then SIGKILL this long after (torchrun forwards SIGTERM to its workers)
EXIT_GRACE_S = 10.0  # the same when the script itself is stopping (within its caller's STOP_GRACE_S)


@dataclass
class Budget:
    """--budget-s: seconds left of it (None: no budget), and whether a row's estimate still fits."""

    seconds: float | None
    start: float = field(default_factory=lambda: time.monotonic())  # (looked up per call: tests patch it)

    def left(self) -> float | None:
        return None if self.seconds is None else self.seconds - (time.monotonic() - self.start)

    def shortfall(self, estimate_s: float) -> str | None:
        """None when a row estimated at `estimate_s` fits what is left, else why not (one line)."""
        left = self.left()
        if left is None or estimate_s <= left:
            return None
        return f"estimated {estimate_s:.0f} s, {max(left, 0.0):.0f} s of --budget-s left"

    def skip_reason(self, estimate_s: float) -> str | None:
        """shortfall() as the reason a row is skipped ("skipped: ..."), or None when it fits."""
        why = self.shortfall(estimate_s)
        return None if why is None else f"skipped: {why}"

    def timeout(self, cap: float | None = None) -> float | None:
        """Seconds a child may run: what is left (at least 1 s), at most `cap`; None when neither bounds it."""
        left = self.left()
        bounds = [t for t in (cap, None if left is None else max(left, 1.0)) if t is not None]
        return min(bounds) if bounds else None


def stop_group(proc: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    """Stop `proc`'s process group (started with start_new_session=True): SIGTERM, then SIGKILL after `grace_s`,
    to whatever of the group is still there even when `proc` itself has already ended."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def wait_or_stop(proc: subprocess.Popen, timeout: float | None, grace_s: float = STOP_GRACE_S) -> int | None:
    """`proc`'s exit code, or None when it was still running after `timeout` seconds and its group was stopped.
    Whatever interrupts the wait (SystemExit from a SIGTERM, KeyboardInterrupt) also stops the group."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_group(proc, grace_s)
        return None
    except BaseException:
        stop_group(proc, EXIT_GRACE_S)
        raise


def exit_on_sigterm() -> None:
    """Make SIGTERM raise SystemExit(143) in the main thread, so that wait_or_stop stops the child group."""

    def handler(signum, frame):  # noqa: ARG001 - signal's signature
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the script at once
        sys.exit(128 + signal.SIGTERM)

    signal.signal(signal.SIGTERM, handler)
