"""The trainer's data loader: infinite micro-batches of packed rows, global resume state, background prefetch.

Global sample sequence. Optimizer step s consumes global samples [s*G, (s+1)*G) (G = global_batch_size in
sequences); `schedule.mixture_assignments` maps each one to (source, row). Which rank reads which sample:
shard sources have lanes (titanloop.data.shards; lanes per source = its share of global_batch_size); lane l of
the Lambda lanes of all sources belongs to rank floor(l*W/Lambda), and a rank reads the samples of its lanes
(`schedule.assign_ranks` hands the few surplus samples of a step to ranks short of G/W). Synthetic sources:
rank r reads the contiguous block [r*G/W, (r+1)*G/W). Each rank's G/W samples, in global order, are split into
grad_accum = G / (micro_batch_size*W) micro-batches. With a batch schedule (the stage-1 batch ramp) G = G(s)
varies by step but never by W.
The sequence never depends on W, so `state_dict()` -- samples consumed per source at the last completed
step -- is the same on every rank and resumes on any number of ranks without repeating or skipping a sample.

State format (JSON-serializable, version 1):
    {"version": 1, "kind": "mds", "seed": 0, "global_samples": 4096, "steps": 16,
     "sources": {"fineweb": {"samples": 3006, "epoch": 0}, "nemotron": {"samples": 1090, "epoch": 0}}}
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import sys
import threading

import numpy as np

from titanloop.config_errors import ConfigError, require
from titanloop.data.packing import rows_to_batch
from titanloop.data.schedule import assign_ranks, lane_quotas, mixture_arrays

STATE_VERSION = 1


def micro_batches_per_rank(
    global_batch: int, micro_batch_size: int, dp_world: int, name: str = "training.global_batch_size"
) -> int:
    """Micro-batches each data-parallel rank runs for a global batch of `global_batch` sequences (gradient
    accumulation); the one check that the global batch tiles micro_batch_size * dp (one-line ConfigError)."""
    require(
        global_batch >= 1 and global_batch % (micro_batch_size * dp_world) == 0,
        name,
        global_batch,
        f"a multiple of micro_batch_size * dp = {micro_batch_size} * {dp_world}",
    )
    return global_batch // (micro_batch_size * dp_world)


def _assignment(js: np.ndarray, ks: np.ndarray, world: int, lane_base: tuple, layout: tuple):
    """(lane owner, assigned rank) of every sample of a global batch; the last few are cached because every
    simulated rank (titanloop.data.locality) asks for the same step."""
    key = (js.ctypes.data, ks.ctypes.data, len(js), world, lane_base, layout)  # js/ks: cached, read-only arrays
    if key not in _ASSIGNED:
        lane = np.empty(len(js), dtype=np.int64)
        for j, (windows, lanes) in enumerate(layout):
            sel = js == j
            lane[sel] = lane_base[j] + (ks[sel] % windows) % lanes
        owner = lane * world // lane_base[-1]
        if len(_ASSIGNED) >= 64:
            _ASSIGNED.pop(next(iter(_ASSIGNED)))
        _ASSIGNED[key] = (js, ks), owner, assign_ranks(owner, world)  # js/ks kept alive: addresses stay unique
    return _ASSIGNED[key][1:]


_ASSIGNED: dict = {}


class PackedLoader:
    """Iterator over micro-batches for one data-parallel rank (see the module docstring for the layout)."""

    def __init__(
        self,
        sources,
        weights,
        *,
        kind: str,
        seed: int,
        micro_batch_size: int,
        global_batch_size: int,
        dp_rank: int,
        dp_world: int,
        prefetch: int = 4,
        batch_schedule=None,
        trace_dir: str | None = None,
        pin_memory: bool = False,
    ):
        require(dp_world >= 1, "dp_world", dp_world, "an integer >= 1")
        require(0 <= dp_rank < dp_world, "dp_rank", dp_rank, f"an integer in [0, {dp_world})")
        require(micro_batch_size >= 1, "micro_batch_size", micro_batch_size, "an integer >= 1")
        self.sources = list(sources)
        self.weights = [float(w) for w in weights]
        self.kind, self.seed = kind, int(seed)
        self.micro_batch_size, self.global_batch_size = micro_batch_size, global_batch_size
        self.dp_rank, self.dp_world = dp_rank, dp_world
        self.grad_accum = micro_batches_per_rank(global_batch_size, micro_batch_size, dp_world)
        # step (0-based) -> global batch in sequences; None = global_batch_size for every step
        self.batch_schedule = batch_schedule
        self.prefetch = prefetch
        self.pin_memory = pin_memory  # page-locked batches (CUDA): their copies to the GPU do not block the loop
        self.trace_path = None
        if trace_dir:
            os.makedirs(trace_dir, exist_ok=True)
            self.trace_path = os.path.join(trace_dir, f"rank-{dp_rank}.jsonl")
        self._lane_base = None  # first global lane of each source (shard sources only)
        if all(hasattr(s, "set_lanes") for s in self.sources):
            quotas = lane_quotas(self.weights, global_batch_size)
            for s, q in zip(self.sources, quotas):
                s.set_lanes(q)
            self._lane_base = np.concatenate([[0], np.cumsum(quotas)]).astype(np.int64)
        self._counts = [0] * len(self.sources)  # per-source samples consumed at the last completed step
        self._steps = 0
        self._thread: threading.Thread | None = None
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()
        self._gen = None

    # ----- resume state -------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "version": STATE_VERSION,
            "kind": self.kind,
            "seed": self.seed,
            "global_samples": sum(self._counts),
            "steps": self._steps,
            "sources": {s.name: {"samples": c, "epoch": s.epoch_of(c)} for s, c in zip(self.sources, self._counts)},
        }

    def load_state_dict(self, state: dict) -> None:
        require(
            state.get("version") == STATE_VERSION,
            "dataloader state version",
            state.get("version"),
            f"{STATE_VERSION} (written by this titanloop)",
        )
        require(
            state.get("kind") == self.kind,
            "dataloader state kind",
            state.get("kind"),
            f"{self.kind!r} (the configured data.kind); resuming on other data needs a fresh run dir",
        )
        require(
            state.get("seed") == self.seed,
            "data.seed",
            self.seed,
            f"{state.get('seed')} (the seed the checkpoint was written with)",
        )
        saved = state.get("sources", {})
        names = [s.name for s in self.sources]
        unknown = sorted(set(saved) - set(names))
        if unknown:
            raise ConfigError(
                f"dataloader state has source(s) {unknown} that are not configured: "
                f"configured sources are {names}; add them back or start a fresh run dir"
            )
        self._shutdown()
        self._counts = [int(saved.get(n, {}).get("samples", 0)) for n in names]
        self._steps = int(state.get("steps", 0))

    def stats(self) -> dict:
        """Counters of this rank: rows emitted fully masked because their shard was bad (on_bad_shard=skip)."""
        return {
            s.name: {"bad_rows": getattr(s, "bad_rows", 0), "bad_shards": len(getattr(s, "bad_shards", ()))}
            for s in self.sources
        }

    # ----- iteration ----------------------------------------------------------------------------
    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if self._gen is None:
            self._gen = self._start()
        batch, state_after, (step, rows) = next(self._gen)
        if self.trace_path:
            self._trace(batch, step, rows)
        if state_after is not None:  # last micro-batch of an optimizer step
            self._counts, self._steps = state_after
        return batch

    def _trace(self, batch: dict, step: int, rows: list) -> None:
        lines = [
            json.dumps(
                {
                    "step": step,
                    "id": sid,
                    "source": self.sources[j].name,
                    "row": k,
                    "world": self.dp_world,
                    "tokens": hashlib.sha1(x.numpy().tobytes()).hexdigest()[:16],
                }
            )
            + "\n"
            for sid, (j, k), x in zip(batch["sample_ids"].tolist(), rows, batch["input_ids"])
        ]
        with open(self.trace_path, "a") as f:
            f.writelines(lines)

    def batch_at(self, step: int) -> int:
        """Global batch (sequences) of optimizer step `step` (0-based)."""
        return self.global_batch_size if self.batch_schedule is None else int(self.batch_schedule(step))

    def grad_accum_at(self, step: int) -> int:
        """Micro-batches this rank yields for optimizer step `step` (0-based)."""
        return micro_batches_per_rank(
            self.batch_at(step), self.micro_batch_size, self.dp_world, f"global batch at step {step}"
        )

    def rank_samples(self, js: np.ndarray, ks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Positions in the global batch (sources js, rows ks) that this rank reads, in order, and whether each
        is in one of its own lanes (else it reads just that row)."""
        g = len(js)
        if self._lane_base is None:
            per_rank = g // self.dp_world
            return np.arange(self.dp_rank * per_rank, (self.dp_rank + 1) * per_rank), np.ones(per_rank, bool)
        owner, assigned = _assignment(
            js, ks, self.dp_world, tuple(self._lane_base.tolist()), tuple((s.windows, s.lanes) for s in self.sources)
        )
        mine = np.flatnonzero(assigned == self.dp_rank)
        return mine, owner[mine] == self.dp_rank

    def _produce(self, counts: list[int], steps: int):
        """Yield (micro-batch, (counts, steps) after the step or None) forever, from the given global state."""
        while True:
            g, accum = self.batch_at(steps), self.grad_accum_at(steps)
            start = sum(counts)
            js, ks, counts = mixture_arrays(counts, self.weights, g)
            steps += 1
            mine, local = self.rank_samples(js, ks)
            mbs = self.micro_batch_size
            for m in range(accum):
                pos = mine[m * mbs : (m + 1) * mbs]
                if self._lane_base is None:
                    rows = [self.sources[js[p]].row(int(ks[p])) for p in pos]
                else:
                    rows = [
                        self.sources[js[p]].row(int(ks[p]), bool(own))
                        for p, own in zip(pos, local[m * mbs : (m + 1) * mbs])
                    ]
                last = m == accum - 1
                picked = [(int(js[p]), int(ks[p])) for p in pos]
                batch = rows_to_batch(rows, [start + int(p) for p in pos])
                if self.pin_memory:  # (in the prefetch thread, off the training loop)
                    batch = {k: v.pin_memory() if hasattr(v, "pin_memory") else v for k, v in batch.items()}
                yield (
                    batch,
                    ((list(counts), steps) if last else None),
                    (steps - 1, picked),
                )

    def _start(self):
        produce = self._produce(list(self._counts), self._steps)
        if self.prefetch == 0:
            return produce
        self._stop.clear()
        self._queue = q = queue.Queue(maxsize=self.prefetch)
        stop = self._stop

        def put(entry) -> bool:
            """Hand `entry` to the consumer unless told to stop (never blocks a stop or a join)."""
            while not stop.is_set():
                try:
                    q.put(entry, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        def work():
            try:
                for item in produce:
                    if not put(("ok", item)):
                        return
            except BaseException as e:  # surfaced in the consumer, never swallowed
                put(("error", e))

        self._thread = threading.Thread(target=work, name=f"titanloop-data-rank{self.dp_rank}", daemon=True)
        self._thread.start()

        def consume():
            while True:
                status, item = q.get()
                if status == "error":
                    raise item
                yield item

        return consume()

    def _shutdown(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=300)  # it stops after the batch it is building (bounded work)
            if self._thread.is_alive():
                print(
                    f"[titanloop] warning: data prefetch thread {self._thread.name} did not stop within 300 s",
                    file=sys.stderr,
                    flush=True,
                )
            self._thread = None
        self._gen = None
        self._queue = None

    def close(self) -> None:
        self._shutdown()

    def __del__(self):
        try:
            self._shutdown()
        except Exception:
            pass
