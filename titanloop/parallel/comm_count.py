"""Count the collectives a piece of code issues, by kind (all_gather, reduce_scatter, all_reduce, ...).

Uses torch.distributed.tensor.debug.CommDebugMode, which sees both DTensor redistributions and the
c10d collectives FSDP2 issues directly.
"""

from __future__ import annotations

import contextlib
from collections import Counter

from torch.distributed.tensor.debug import CommDebugMode

_KINDS = ("all_gather", "allgather", "reduce_scatter", "all_reduce", "allreduce", "broadcast", "all_to_all",
          "alltoall")
_CANONICAL = {"allgather": "all_gather", "allreduce": "all_reduce", "alltoall": "all_to_all"}


def _kind(op) -> str:
    name = str(op).lower()
    for k in _KINDS:
        if k in name:
            return _CANONICAL.get(k, k)
    return name


@contextlib.contextmanager
def count_collectives():
    """with count_collectives() as counts: ...  -> counts is a Counter {kind: number of calls}."""
    counts: Counter = Counter()
    mode = CommDebugMode()
    with mode:
        yield counts
    for op, n in mode.get_comm_counts().items():
        counts[_kind(op)] += n
