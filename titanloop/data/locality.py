"""Read amplification of the shard loader at any world size, with every rank simulated in one process.

    from titanloop.data.locality import read_amplification
    r = read_amplification(cfg, seq_len=4096, global_batch_size=1024, world=1024, steps=20, vocab_size=49152)
    r["amplification"]   # bytes fetched by all ranks / bytes of the rows they used

Each simulated rank is a real PackedLoader (prefetch off) over its own copies of the sources (own cache, own
byte counters), reading exactly what that rank would read in training. Fetched bytes count every shard byte
range and every shard index a rank reads (the manifest, read once at startup, is reported apart). Used bytes
are what reading the rows' part of the set once costs: (seq_len + 1) tokens per row times the set's shard
bytes per token (document records with their metadata and headers). 1.0 = every byte fetched once, by one rank.

Shuffle quality is reported with the same run: the corpus distance (tokens, in manifest order) between
consecutive rows one rank reads from one source, and the number of distinct shards one global batch touches.
"""

from __future__ import annotations

import numpy as np

from titanloop.data.config import DataConfig
from titanloop.data.loader import PackedLoader
from titanloop.data.shards import open_shard_sources


def read_amplification(
    cfg: DataConfig,
    *,
    seq_len: int,
    global_batch_size: int,
    world: int,
    steps: int,
    vocab_size: int,
    micro_batch_size: int = 1,
    sources=None,
    rows_out: dict | None = None,
) -> dict:
    """Run `steps` optimizer steps on `world` simulated ranks; bytes, requests and shuffle statistics.
    `sources`: already opened sources of cfg (reused across calls: each rank clones them). `rows_out`: filled
    with {global sample id: hash of its input tokens}."""
    base = sources or open_shard_sources(cfg, seq_len=seq_len, vocab_size=vocab_size)
    weights = [s.weight for s in cfg.sources]
    fetched = used = requests = rows = 0
    distances: list[np.ndarray] = []
    step_shards = [set() for _ in range(steps)]
    max_rank_fetched = evictions = max_cache = 0
    for rank in range(world):
        srcs = [s.clone() for s in base]
        for s in srcs:
            s.trace = []
        ld = PackedLoader(
            srcs,
            weights,
            kind=cfg.kind,
            seed=cfg.seed,
            micro_batch_size=micro_batch_size,
            global_batch_size=global_batch_size,
            dp_rank=rank,
            dp_world=world,
            prefetch=0,
        )
        marks = []
        for step in range(steps):
            for _ in range(ld.grad_accum_at(step)):
                batch = next(ld)
                rows += len(batch["sample_ids"])
                if rows_out is not None:
                    for sid, x in zip(batch["sample_ids"].tolist(), batch["input_ids"]):
                        rows_out[sid] = hash(x.numpy().tobytes())
            marks.append([len(s.trace) for s in srcs])
        evictions += sum(s._cache.evictions for s in srcs)
        max_cache = max([max_cache] + [s._cache.peak for s in srcs])
        rank_fetched = sum(s.fetcher.bytes_fetched for s in srcs)
        max_rank_fetched = max(max_rank_fetched, rank_fetched)
        fetched += rank_fetched
        requests += sum(s.fetcher.requests for s in srcs)
        used += sum(s.used_bytes for s in srcs)
        for j, s in enumerate(srcs):
            offs = np.asarray([o for _, o in s.trace], dtype=np.int64)
            if len(offs) > 1:
                distances.append(np.abs(np.diff(offs)))
            shard_of = np.searchsorted(s.token_offsets, offs, side="right") - 1
            lo = 0
            for step, mark in enumerate(marks):
                step_shards[step].update((j, int(x)) for x in shard_of[lo : mark[j]])
                lo = mark[j]
        ld.close()
    d = np.concatenate(distances) if distances else np.zeros(1, np.int64)
    corpus = sum(int(s.token_offsets[-1]) for s in base)
    return {
        "world": world,
        "steps": steps,
        "global_batch_size": global_batch_size,
        "seq_len": seq_len,
        "rows": rows,
        "bytes_fetched": fetched,
        "bytes_used": used,
        "amplification": fetched / max(used, 1),
        "requests": requests,
        "max_rank_bytes_fetched": max_rank_fetched,
        "cache_evictions": evictions,
        "max_cache_bytes": max_cache,
        "manifest_bytes_per_rank": sum(len(s.manifest.to_json()) for s in base),
        "shards": sum(len(s.manifest.shards) for s in base),
        "corpus_tokens": corpus,
        "consecutive_row_distance_tokens_median": float(np.median(d)),
        "consecutive_row_distance_tokens_p90": float(np.percentile(d, 90)),
        "distinct_shards_per_global_batch_mean": float(np.mean([len(x) for x in step_shards])),
    }
