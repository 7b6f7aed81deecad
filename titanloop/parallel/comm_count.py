"""Count the collectives a piece of code issues, by kind (all_gather, reduce_scatter, all_reduce, ...).

Uses torch.distributed.tensor.debug.CommDebugMode, which sees both DTensor redistributions and the
c10d collectives FSDP2 issues directly.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

_KINDS = ("all_gather", "allgather", "reduce_scatter", "all_reduce", "allreduce", "broadcast", "all_to_all", "alltoall")
_CANONICAL = {"allgather": "all_gather", "allreduce": "all_reduce", "alltoall": "all_to_all"}


def _kind(op) -> str:
    name = str(op).lower()
    for k in _KINDS:
        if k in name:
            return _CANONICAL.get(k, k)
    return name


_COUNTED = set(_CANONICAL.values()) | {"reduce_scatter", "broadcast"}  # canonical kinds


@contextlib.contextmanager
def count_collectives():
    """with count_collectives() as counts: ...  -> counts is a Counter {kind: number of calls}."""
    counts: Counter = Counter()
    mode = CommDebugMode()
    with mode:
        yield counts
    for op, n in mode.get_comm_counts().items():
        counts[_kind(op)] += n


class _CollectiveBytes(TorchDispatchMode):
    """Sums the buffer bytes of every collective op dispatched (the gathered output of an all-gather, the input of
    a reduce-scatter, the tensors of an all-reduce); works on fake tensors, so on the dry run's fake backend."""

    def __init__(self, counts: Counter):
        super().__init__()
        self.counts = counts
        self.in_all_gather_single = False  # counted by count_collective_bytes' wrapper already

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = _kind(func)
        if kind == "all_gather" and self.in_all_gather_single:
            return func(*args, **(kwargs or {}))
        if kind in _COUNTED and getattr(func, "namespace", "") in ("c10d", "_c10d_functional"):
            tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            sizes = [t.numel() * t.element_size() for t in tensors]
            self.counts[kind] += sum(sizes) if kind == "all_reduce" else max(sizes, default=0)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def count_collective_bytes():
    """with count_collective_bytes() as nbytes: ...  -> nbytes is a Counter {kind: buffer bytes}. A ring
    all-gather or reduce-scatter of a B-byte buffer sends (N-1)/N * B bytes per rank, an all-reduce twice that."""
    import torch.distributed as dist

    counts: Counter = Counter()
    mode = _CollectiveBytes(counts)
    # FSDP2's all-gather goes through dist.all_gather_single (torch >= 2.12), which may or may not reach the
    # dispatcher as a c10d op (on the fake backend it does): count it here, once, and let the mode skip what it
    # issues. torch 2.11 has no all_gather_single (FSDP2 calls all_gather_into_tensor, which the mode counts).
    all_gather_single = getattr(dist, "all_gather_single", None)

    def counted_all_gather_single(output_tensor, input_tensor, *args, **kwargs):
        counts["all_gather"] += output_tensor.numel() * output_tensor.element_size()
        mode.in_all_gather_single = True
        try:
            return all_gather_single(output_tensor, input_tensor, *args, **kwargs)
        finally:
            mode.in_all_gather_single = False

    if all_gather_single is not None:
        dist.all_gather_single = counted_all_gather_single
    try:
        with mode:
            yield counts
    finally:
        if all_gather_single is not None:
            dist.all_gather_single = all_gather_single
