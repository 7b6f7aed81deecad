"""Measurement helpers shared by the benchmark scripts: peak tensor memory and wall-clock timing.

    with PeakMemory(model) as mem:          # params/buffers of `model` counted, plus everything the block allocates
        step()
    mem.peak_bytes, mem.peak_by_kind        # {'Parameter': .., 'Gradient': .., 'Activation': .., 'Temp': .., ...}

    timings = time_repeated({"a": step_a, "b": step_b}, warmup=2, repeats=5)
    timings["a"]["median"], timings["a"]["min"], timings["a"]["max"]

PeakMemory counts tensor storages, not the process RSS: it uses PyTorch's MemTracker
(torch.distributed._tools.mem_tracker), a TorchDispatchMode that sees every storage an aten op creates or frees
and records the maximum of their sum. It works on CPU tensors, so loss-memory comparisons do not need a GPU.
Memory inside a single kernel (workspaces) and allocator caching/fragmentation are not counted.
"""

from __future__ import annotations

import functools
import statistics
import time
from typing import Callable

import torch
from torch.distributed._tools.mem_tracker import MemTracker

MiB = 1024 * 1024


class PeakMemory:
    """Context manager: peak bytes of live tensor storages on `device` while the block runs.

    `track`: modules / optimizers / tensors created before the block whose storage should count (their
    parameters, gradients and optimizer states); anything else created before the block is not counted.
    """

    def __init__(self, *track, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        self._tracker = MemTracker()
        if track:
            self._tracker.track_external(*track)
        self.peak_bytes = 0
        self.peak_by_kind: dict[str, int] = {}

    def __enter__(self) -> "PeakMemory":
        self._tracker.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._tracker.__exit__(*exc)
        snap = self._tracker.get_tracker_snapshot("peak").get(self.device, {})
        self.peak_by_kind = {str(getattr(k, "value", k)): int(v) for k, v in snap.items()}
        self.peak_bytes = self.peak_by_kind.pop("Total", 0)


def peak_memory(fn: Callable[[], object], *track, device: str = "cpu") -> PeakMemory:
    """Run fn() once under PeakMemory and return the tracker (peak_bytes, peak_by_kind)."""
    with PeakMemory(*track, device=device) as mem:
        fn()
    return mem


def _stats(times: list[float]) -> dict:
    q = statistics.quantiles(times, n=4) if len(times) >= 2 else [times[0]] * 3
    return {
        "median": statistics.median(times),
        "min": min(times),
        "max": max(times),
        "iqr": q[2] - q[0],
        "repeats": len(times),
        "times": times,
    }


def time_repeated(fns: dict[str, Callable[[], object]], warmup: int = 2, repeats: int = 5) -> dict[str, dict]:
    """Wall-clock seconds per call of each fn: `warmup` untimed calls, then `repeats` timed rounds.

    The candidates alternate inside each round (a, b, a, b, ...) so that load from other processes on a shared
    machine hits all of them alike. Returns {name: {median, min, max, iqr, repeats, times}}.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats={repeats}, warmup={warmup} are invalid: expected repeats >= 1, warmup >= 0")
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: _stats(ts) for name, ts in times.items()}


def time_fn(fn: Callable[[], object], warmup: int = 2, repeats: int = 5) -> dict:
    """time_repeated for a single function."""
    return time_repeated({"fn": fn}, warmup, repeats)["fn"]


def training_step(model, ids: torch.Tensor, n_loops: int) -> Callable[[], float]:
    """One forward + stage-1 loss + backward of a LoopLM on fixed token ids (the step the speed benchmarks time)."""
    from titanloop.objectives import per_loop_cross_entropy, stage1_loss

    inputs, targets = ids[:, :-1], ids[:, 1:]
    mask = torch.ones_like(targets, dtype=torch.bool)

    def step() -> float:
        out = model(inputs, n_loops=n_loops)
        ce = per_loop_cross_entropy(out.readouts, model.lm_head.weight, targets)
        loss, _ = stage1_loss(ce, out.gate_logits, mask, beta=0.05)
        loss.backward()
        model.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step


def per_loop_checkpointing(loop_step):
    """A LoopLM loop_wrapper: activation checkpointing around each loop (non-reentrant)."""
    from torch.utils.checkpoint import checkpoint

    return functools.partial(checkpoint, loop_step, use_reentrant=False)


def spread(values: list[float]) -> dict:
    """{min, median, max} of a load-dependent figure over repeats (the median is the one judged)."""
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def fmt_spread(s: dict, fmt: str = ".3f") -> str:
    """'min / median / max' of a spread() dict."""
    return " / ".join(format(s[k], fmt) for k in ("min", "median", "max"))


def regen_command(script: str, argv: list[str] | None) -> str:
    """The command that measured a record: `python benchmarks/<script>.py` with `argv` (sys.argv's by default)
    without its --out, which only chose where the record went."""
    import shlex
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    kept, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a == "--out":
            skip = True
        elif not a.startswith("--out="):
            kept.append(a)
    return shlex.join(["python", f"benchmarks/{script}.py", *kept])


def machine() -> str:
    """Where a benchmark ran, in words: cores, accelerator, and the load average when it finished."""
    import os

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU only"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return f"{os.cpu_count()}-core machine, {gpu}, torch {torch.__version__}, load average {load:.1f} at the end"


def machine_slug() -> str:
    """The machine part of a record's name: the GPU's model in lower case ("h100"), or "cpu"."""
    import re

    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name(0)
    m = re.search(r"\b([A-Z]+\d+[A-Za-z]*)\b", name.replace("NVIDIA", ""))
    return (m.group(1) if m else re.sub(r"[^a-z0-9]+", "", name.lower()) or "gpu").lower()


def record_path(what: str, results=None):
    """A new record's path, benchmarks/results/<today>-<machine>-<what>.json (fresh_path: never an existing one)."""
    import datetime
    from pathlib import Path

    from benchmarks.report import RESULTS
    from titanloop.checks.runs import fresh_path

    name = f"{datetime.date.today().isoformat()}-{machine_slug()}-{what.replace('_', '-')}.json"
    return fresh_path(Path(results or RESULTS) / name)


def head_commit() -> str:
    """The commit measured (HEAD, full hash); a warning when the working tree has uncommitted changes, which the
    record cannot name."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    git = ["git", "-C", str(repo)]
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
    if dirty.stdout.strip():
        print(f"warning: uncommitted changes: the record names commit {head[:10]}, not what ran", file=sys.stderr)
    return head or "unknown"


def stamp(report: dict) -> dict:
    """A record with its date, commit and torch added."""
    import datetime

    return {**report, "date": datetime.date.today().isoformat(), "commit": head_commit(), "torch": torch.__version__}


def write_report(path, what: str, report: dict) -> dict:
    """Add date, commit and torch to a record (benchmarks/report.py schema), check it and write it: to `path`, or
    by default to a new dated record, benchmarks/results/<date>-<machine>-<what>.json. Never overwrites a file: when
    `path` exists, the record goes beside it (fresh_path) and a line says where."""
    import json
    import sys

    from benchmarks.report import validate
    from titanloop.checks.runs import fresh_path

    report = stamp(report)
    out = fresh_path(path) if path else record_path(what)
    validate(out, report)
    if path and str(out) != str(path):
        print(f"{path} exists and a record is never overwritten: writing {out}", file=sys.stderr)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")
    return report
