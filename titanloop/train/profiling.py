"""Profiler traces and CUDA memory snapshots for a window of steps (the `[profiling]` section).

    <run_dir>/profiles/step_N/rank{R}_trace.json             torch.profiler trace of steps N .. N+steps-1, one per
                                                              rank (chrome://tracing, https://ui.perfetto.dev)
    <run_dir>/profiles/step_N/rank{R}_memory_snapshot.pickle  CUDA only: the allocator's history up to the end of
                                                              the window (https://pytorch.org/memory_viz)
    <run_dir>/profiles/step_N/rank{R}_memory_summary.txt      CUDA only: peak allocated/reserved, largest blocks
    <run_dir>/profiles/oom/rank{R}_memory_snapshot.pickle     CUDA only: written by the rank that runs out of memory
                                                              (+ its summary)

The trace covers CPU and, on CUDA, GPU activity of the window (callbacks included). With
`memory_snapshot = true` on CUDA, allocator history (`torch.cuda.memory._record_memory_history`, last
`memory_snapshot_entries` events) is recorded from the start of training, so both the window's snapshot and an
out-of-memory snapshot show how memory got there. On CPU the memory snapshot is skipped (one line says so).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path

import torch

from titanloop.config_errors import require
from titanloop.train.callbacks import Callback, StepResult


@dataclass
class ProfilingSection:
    """torch.profiler traces and CUDA memory snapshots for a window of steps (titanloop.train.profiling)."""

    enable: bool = False
    start_step: int = 10  # first profiled step
    steps: int = 2  # steps in the window
    memory_snapshot: bool = True  # CUDA only: record allocator history over the window, dump a pickle (+ on OOM)
    memory_snapshot_entries: int = 100000  # allocator events kept

    def validate(self):
        require(self.start_step >= 1, "profiling.start_step", self.start_step, "an integer >= 1")
        require(self.steps >= 1, "profiling.steps", self.steps, "an integer >= 1")
        require(
            self.memory_snapshot_entries >= 1,
            "profiling.memory_snapshot_entries",
            self.memory_snapshot_entries,
            "an integer >= 1",
        )


class CudaMemory:
    """The CUDA allocator calls the callback makes (a seam for tests without a GPU)."""

    def record(self, max_entries: int) -> None:
        torch.cuda.memory._record_memory_history(max_entries=max_entries)

    def stop(self) -> None:
        torch.cuda.memory._record_memory_history(enabled=None)

    def snapshot(self) -> dict:
        return torch.cuda.memory._snapshot()

    def peaks(self) -> tuple[int, int]:
        return torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()

    def on_oom(self, fn) -> None:
        torch._C._cuda_attach_out_of_memory_observer(fn)


def memory_summary(snapshot: dict, peaks: tuple[int, int], top: int = 10) -> str:
    """A short text summary of an allocator snapshot: peaks, live memory by segment, the largest live blocks."""
    blocks = [
        b for seg in snapshot.get("segments", []) for b in seg.get("blocks", []) if b.get("state") == "active_allocated"
    ]
    reserved = sum(seg.get("total_size", 0) for seg in snapshot.get("segments", []))
    lines = [
        f"peak allocated {peaks[0] / 2**30:.3f} GiB, peak reserved {peaks[1] / 2**30:.3f} GiB",
        f"at the snapshot: {sum(b['size'] for b in blocks) / 2**30:.3f} GiB live in {len(blocks)} blocks, "
        f"{reserved / 2**30:.3f} GiB reserved in {len(snapshot.get('segments', []))} segments",
        "largest live blocks (size, allocated at):",
    ]
    for b in sorted(blocks, key=lambda b: -b["size"])[:top]:
        frames = b.get("frames") or []
        where = (
            next(
                (f"{f['filename']}:{f['line']} {f['name']}" for f in frames if "torch/" not in f.get("filename", "")),
                "?",
            )
            if frames
            else "?"
        )
        lines.append(f"  {b['size'] / 2**20:10.1f} MiB  {where}")
    return "\n".join(lines) + "\n"


class Profiling(Callback):
    """torch.profiler over steps [start_step, start_step + steps); CUDA memory snapshots (module docstring)."""

    def __init__(self, run, cuda_memory: CudaMemory | None = None):
        p = run.cfg.profiling
        self.first, self.last = p.start_step, p.start_step + p.steps - 1
        self.root = Path(run.cfg.training.run_dir) / "profiles"
        self.rank = run.mesh.rank
        self.cuda = run.mesh.device_type == "cuda"
        self.memory = (cuda_memory or CudaMemory()) if self.cuda and p.memory_snapshot else None
        self.max_entries = p.memory_snapshot_entries
        self.profiler = None
        self.span = None  # the open "ProfilerStep#N" span of the step being traced
        if p.memory_snapshot and not self.cuda and self.rank == 0:
            print(
                "[titanloop] profiling.memory_snapshot: CUDA only, skipped on this "
                f"{run.mesh.device_type} run (the profiler trace is still written)",
                flush=True,
            )

    def pre_train(self, run) -> None:
        if self.memory is not None:
            self.memory.record(self.max_entries)
            self.memory.on_oom(self._out_of_memory)

    def pre_step(self, run) -> None:
        if run.state.step == self.first:
            self._start()
        self._open_span(run)

    def _start(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(activities=activities, record_shapes=True)
        self.profiler.__enter__()

    def _open_span(self, run) -> None:
        """One "ProfilerStep#N" span per traced step, as torch's scheduled profiler names them, so a trace reader
        can cut the trace into steps (without a schedule, torch.profiler records no such span)."""
        if self.profiler is not None:
            self.span = torch.profiler.record_function(f"ProfilerStep#{run.state.step}")
            self.span.__enter__()

    def post_step(self, run, result: StepResult) -> None:
        self._close_span()
        if result.step == self.last or (self.profiler is not None and run.state.exit_code is not None):
            self._finish(result.step)

    def _close_span(self) -> None:
        if self.span is not None:
            self.span.__exit__(None, None, None)
            self.span = None

    def _finish(self, step: int) -> None:
        if self.profiler is None:
            return
        self._close_span()
        out = self.root / f"step_{self.first}"
        out.mkdir(parents=True, exist_ok=True)
        self.profiler.__exit__(None, None, None)
        self.profiler.export_chrome_trace(str(out / f"rank{self.rank}_trace.json"))
        self.profiler = None
        if self.memory is not None:
            self._dump(out)
        if self.rank == 0:
            print(
                f"[titanloop] profiler: steps {self.first}-{step} traced to {out}/rank*_trace.json"
                + (" (+ CUDA memory snapshots)" if self.memory is not None else ""),
                flush=True,
            )

    def _dump(self, out: Path) -> None:
        snapshot = self.memory.snapshot()
        out.mkdir(parents=True, exist_ok=True)
        with open(out / f"rank{self.rank}_memory_snapshot.pickle", "wb") as f:
            pickle.dump(snapshot, f)
        (out / f"rank{self.rank}_memory_summary.txt").write_text(memory_summary(snapshot, self.memory.peaks()))

    def _out_of_memory(self, device, alloc, device_alloc, device_free) -> None:
        out = self.root / "oom"
        self._dump(out)
        print(
            f"[titanloop] rank {self.rank} ran out of CUDA memory (asked {alloc / 2**20:.1f} MiB): memory snapshot "
            f"in {out}/rank{self.rank}_memory_snapshot.pickle",
            flush=True,
        )

    def close(self) -> None:
        if self.profiler is not None:  # the run ended inside the window
            self._finish(self.last)
        if self.memory is not None:
            self.memory.stop()
