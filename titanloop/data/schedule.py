"""The global sample sequence: which source and which of its rows each global sample index reads.

Global sample g is drawn from the source that is furthest behind its share (deficit / smooth weighted
round robin): j = argmax_j (w_j * (g + 1) - c_j), ties to the lowest j, where c_j counts samples already
taken from source j. This is deterministic, keeps every prefix within one sample of the stated proportions,
and depends only on the per-source counts -- which is exactly the resume state. Nothing depends on the
number of data-parallel ranks: ranks only choose which samples of each global batch they materialize
(`assign_ranks`).
"""

from __future__ import annotations

import functools

import numpy as np


def mixture_assignments(counts: list[int], weights: list[float], n: int) -> tuple[list[tuple[int, int]], list[int]]:
    """The next `n` global samples as (source index, row index within that source), and the updated counts."""
    js, ks, after = mixture_arrays(counts, weights, n)
    return list(zip(js.tolist(), ks.tolist())), list(after)


def mixture_arrays(counts, weights, n: int) -> tuple[np.ndarray, np.ndarray, tuple]:
    """mixture_assignments as arrays: source index [n], row index [n] (read-only), updated counts."""
    return _mixture(tuple(int(c) for c in counts), tuple(float(w) for w in weights), int(n))


@functools.lru_cache(maxsize=256)  # every rank (and every simulated rank) computes the same step
def _mixture(counts: tuple, weights: tuple, n: int) -> tuple[np.ndarray, np.ndarray, tuple]:
    picks, after = _deficit(list(counts), weights, n)
    js = np.fromiter((j for j, _ in picks), dtype=np.int64, count=n)
    ks = np.fromiter((k for _, k in picks), dtype=np.int64, count=n)
    js.flags.writeable = ks.flags.writeable = False
    return js, ks, after


def _deficit(counts: list, weights: tuple, n: int):
    if len(weights) == 1:
        start = counts[0]
        return tuple((0, start + i) for i in range(n)), (start + n,)
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    c = np.asarray(counts, dtype=np.float64)
    total = int(c.sum())
    out = []
    for i in range(n):
        j = int(np.argmax(w * (total + i + 1) - c))
        out.append((j, int(c[j])))
        c[j] += 1
    return tuple(out), tuple(int(x) for x in c)


def lane_quotas(weights: list[float], global_batch: int) -> list[int]:
    """Lanes per source: its share of the global batch, largest remainder, at least 1 (never depends on W)."""
    w = np.asarray(weights, dtype=np.float64)
    exact = w / w.sum() * global_batch
    q = np.floor(exact).astype(np.int64)
    for j in np.argsort(-(exact - q), kind="stable")[: global_batch - int(q.sum())]:
        q[j] += 1
    return [max(1, int(x)) for x in q]


def assign_ranks(owner: np.ndarray, world: int) -> np.ndarray:
    """Rank of each sample of a global batch: its lane's owner while that owner has fewer than n/world samples;
    the surplus (a lane that got two rows this step, or no lanes at all) goes, in sample order, to the ranks
    still short of n/world, lowest rank first. Every rank gets exactly n/world samples; deterministic."""
    n = len(owner)
    quota = n // world
    order = np.argsort(owner, kind="stable")
    sorted_owner = owner[order]
    rank_in_owner = np.arange(n) - np.searchsorted(sorted_owner, sorted_owner, side="left")
    keep = rank_in_owner < quota
    assigned = np.full(n, -1, dtype=np.int64)
    assigned[order[keep]] = sorted_owner[keep]
    have = np.bincount(assigned[assigned >= 0], minlength=world)
    assigned[assigned < 0] = np.repeat(np.arange(world), quota - have)
    return assigned
