"""Where a step's time goes, and which rank is slow (`metrics.breakdown`, `metrics.straggler_warn`).

On log steps only (step 1 and every `metrics.log_freq`), the loop times its phases:

    data       waiting for the next micro-batch (the loader's prefetch queue)
    forward    forward T loops + the per-loop objective (with FSDP's parameter all-gathers)
    backward   backward (with FSDP's gradient reduce-scatters)
    allreduce  the gradient norm and the one all-reduce of [loss, per-loop statistics], read back with the norm
    optimizer  clip + optimizer + LR step
    wait       barriers that end each phase: time this rank waits for slower ranks

A barrier ends each phase on log steps, so a rank that is slow in a phase does not show up as other ranks' time
in a later phase; it shows up as their `wait`. A rank's busy time is its step time minus its wait. The phases
are measured (nothing is a remainder), so their sum falls short of the step time only by the untimed glue
(zero_grad, statistics, callbacks' pre_optim_step). Once per log step every rank's [step, busy, phases] is
all-gathered (one small collective); rank 0 reports the slowest rank against the median rank (the lower median,
an actual rank) and warns in one line when it is `metrics.straggler_warn` times slower.
CUDA: each phase ends with torch.cuda.synchronize(), so GPU work is counted in the phase that queued it and the
exposed (not overlapped) part of FSDP's collectives is inside forward/backward; the profiler trace
(`[profiling]`) separates kernels from collectives. Other steps run with no barrier and no synchronize.

The whole-step profile (`metrics.step_profile`, off by default) times, on the same log steps, every part of one
loop iteration from the callbacks' pre_step to their post_step, in the order they run:

    pre_step    the callbacks' pre_step (garbage collection, the profiler window)
    zero_grad   dropping the previous step's gradients
    data        waiting for the next micro-batch
    h2d         copying it to the device
    model       forward T loops
    objective   the per-loop objective (loss, and on log steps the per-loop statistics)
    backward    backward (with FSDP's gradient reduce-scatters)
    statistics  summing loss and statistics over micro-batches
    grad_norm   the gradient norm (one all-reduce per mesh group)
    allreduce   packing, all-reducing and reading back [loss, statistics, grad norm] (the step's one host read)
    pre_optim   the callbacks' pre_optim_step (the non-finite loss check)
    clip        scaling the gradients to training.max_norm
    optimizer   the optimizer step
    lr          the LR scheduler step
    post_step   the callbacks' post_step (metrics, checkpoint, preemption, non-finite stop, validation)
    wait        the breakdown's barriers and its all-gather of every rank's times (metrics.breakdown)

On CUDA each part ends with torch.cuda.synchronize() (only while profiling). The parts are measured, and the wall
time of the iteration minus their sum is reported as `uncovered` (interpreter glue between the parts). Rank 0
prints one `profile` line per profiled step and appends it to <run_dir>/step_profile.jsonl, with each callback's
own time (pre_step/<Name>, post_step/<Name>; inside, not in addition to, pre_step and post_step).
"""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

PHASES = ("data", "forward", "backward", "allreduce", "optimizer", "wait")
PARTS = (
    "pre_step",
    "zero_grad",
    "data",
    "h2d",
    "model",
    "objective",
    "backward",
    "statistics",
    "grad_norm",
    "allreduce",
    "pre_optim",
    "clip",
    "optimizer",
    "lr",
    "post_step",
    "wait",
)


class StepTimer:
    """Phase times of one step (module docstring); inactive (free) unless `active`."""

    def __init__(
        self,
        active: bool,
        device_type: str = "cpu",
        *,
        synchronize=None,
        barrier=None,
        all_gather=None,
        clock=time.perf_counter,
        profile: bool = False,
    ):
        self.active = active
        self.profile = profile  # the whole-step profile (metrics.step_profile): `part` times
        self.clock = clock
        self.times = dict.fromkeys(PHASES, 0.0)
        self.parts: dict[str, float] = {}
        cuda = device_type == "cuda"
        self._synchronize = synchronize or (torch.cuda.synchronize if cuda else (lambda: None))
        self._barrier = barrier or (dist.barrier if dist.is_initialized() else (lambda: None))
        self._all_gather = all_gather or (lambda x: _all_gather(x.to(device_type)))  # NCCL gathers CUDA tensors

    @classmethod
    def for_step(cls, run, step: int) -> "StepTimer":
        m = run.cfg.metrics
        # not while metrics.count_comms counts the step's collectives (the barriers would be counted)
        log_step = step % m.log_freq == 0 or step == 1
        active = m.breakdown and not m.count_comms and log_step
        return cls(active, run.mesh.device_type, profile=m.step_profile and log_step)

    @contextmanager
    def part(self, name: str):
        """Whole-step profile: add the time of the block (device work included) to `name`; free when off."""
        if not self.profile:
            yield
            return
        start = self.clock()
        try:
            yield
        finally:
            self._synchronize()
            self.parts[name] = self.parts.get(name, 0.0) + self.clock() - start

    @contextmanager
    def phase(self, name: str):
        """Time `name` (device work included), then wait at a barrier for the other ranks (timed as `wait`)."""
        if not self.active:
            yield
            return
        start = self.clock()
        try:
            yield
        finally:
            self._synchronize()
            ended = self.clock()
            self.times[name] += ended - start
            self._barrier()
            self._synchronize()
            waited = self.clock() - ended
            self.times["wait"] += waited
            if self.profile:
                self.parts["wait"] = self.parts.get("wait", 0.0) + waited

    def finish(self, step_seconds: float) -> dict:
        """{} when inactive; else this rank's phase times and every rank's [step, busy] (one all-gather)."""
        if not self.active:
            return {}
        mine = [step_seconds, step_seconds - self.times["wait"], *(self.times[p] for p in PHASES)]
        ranks = self._all_gather(torch.tensor(mine, dtype=torch.float64))
        return {
            "phases": dict(self.times),
            "step": step_seconds,
            "rank_step": [r[0] for r in ranks],
            "rank_busy": [r[1] for r in ranks],
        }


def profile_record(step: int, wall_seconds: float, parts: dict) -> dict:
    """One profiled step: its wall time, every part (PARTS order, then each callback's), and what no part covers."""
    top = {p: parts.get(p, 0.0) for p in PARTS}
    covered = sum(top.values())
    detail = {k: v for k, v in parts.items() if "/" in k}
    return {
        "step": step,
        "wall_s": wall_seconds,
        "parts": top,
        "callbacks": detail,
        "uncovered_s": wall_seconds - covered,
        "covered": covered / wall_seconds if wall_seconds > 0 else 1.0,
    }


def profile_line(record: dict) -> str:
    wall = record["wall_s"]
    parts = " ".join(f"{p} {1e3 * v:.1f}" for p, v in record["parts"].items() if v > 0)
    return (
        f"profile {record['step']:5d} | wall {1e3 * wall:.1f} ms = {parts} | uncovered "
        f"{1e3 * record['uncovered_s']:.1f} ms ({100 * (1 - record['covered']):.1f}%)"
    )


def _all_gather(x: torch.Tensor) -> list[list[float]]:
    if not dist.is_initialized():
        return [x.tolist()]
    out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(out, x)
    return [t.cpu().tolist() for t in out]


def breakdown_scalars(timings: dict) -> dict:
    """The metrics of one log step's timings: time/<phase>_s, the step, busy time and the slowest rank."""
    if not timings:
        return {}
    busy = timings["rank_busy"]
    slowest = max(range(len(busy)), key=busy.__getitem__)
    median = statistics.median_low(busy)
    out = {f"time/{p}_s": v for p, v in timings["phases"].items()}
    out.update(
        {
            "time/step_s": timings["step"],
            "time/busy_s": timings["step"] - timings["phases"]["wait"],
            "time/slowest_rank": slowest,
            "time/slowest_busy_s": busy[slowest],
            "time/median_busy_s": median,
            "time/slowest_vs_median": busy[slowest] / median if median > 0 else float("inf"),
        }
    )
    return out


def breakdown_line(step: int, s: dict) -> str:
    phases = " + ".join(f"{p} {s[f'time/{p}_s']:.3f}" for p in PHASES)
    untimed = s["time/step_s"] - sum(s[f"time/{p}_s"] for p in PHASES)
    return (
        f"time {step:5d} | step {s['time/step_s']:.3f} s = {phases} (+{untimed:.3f} untimed) | slowest rank "
        f"{s['time/slowest_rank']}: busy {s['time/slowest_busy_s']:.3f} s vs median rank "
        f"{s['time/median_busy_s']:.3f} s ({s['time/slowest_vs_median']:.2f}x)"
    )


def straggler_warning(step: int, s: dict, threshold: float) -> str | None:
    if not s or threshold <= 0 or s["time/slowest_vs_median"] < threshold:
        return None
    return (
        f"[titanloop] warning: straggler at step {step}: rank {s['time/slowest_rank']} busy "
        f"{s['time/slowest_busy_s']:.3f} s is {s['time/slowest_vs_median']:.2f}x the median rank's "
        f"{s['time/median_busy_s']:.3f} s (metrics.straggler_warn = {threshold:g})"
    )
