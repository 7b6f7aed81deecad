"""The global sample sequence: which source and which of its rows each global sample index reads.

Global sample g is drawn from the source that is furthest behind its share (deficit / smooth weighted
round robin): j = argmax_j (w_j * (g + 1) - c_j), ties to the lowest j, where c_j counts samples already
taken from source j. This is deterministic, keeps every prefix within one sample of the stated proportions,
and depends only on the per-source counts -- which is exactly the resume state. Nothing depends on the
number of data-parallel ranks: ranks only choose which slice of each global batch they materialize.
"""

from __future__ import annotations

import numpy as np


def mixture_assignments(counts: list[int], weights: list[float], n: int) -> tuple[list[tuple[int, int]], list[int]]:
    """The next `n` global samples as (source index, row index within that source), and the updated counts."""
    counts = list(counts)
    if len(weights) == 1:
        start = counts[0]
        return [(0, start + i) for i in range(n)], [start + n]
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    c = np.asarray(counts, dtype=np.float64)
    total = int(c.sum())
    out = []
    for i in range(n):
        j = int(np.argmax(w * (total + i + 1) - c))
        out.append((j, int(c[j])))
        c[j] += 1
    return out, [int(x) for x in c]


def rank_slice(global_batch_size: int, micro_batch_size: int, dp_rank: int, dp_world: int) -> tuple[int, int]:
    """[start, stop) of the global batch that `dp_rank` reads: contiguous, equal blocks, one per rank."""
    per_rank = global_batch_size // dp_world
    return dp_rank * per_rank, (dp_rank + 1) * per_rank
