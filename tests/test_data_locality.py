"""Locality by design: at 1 to 1024 simulated ranks each rank reads (nearly) only the bytes it uses, and the
global sample sequence is the same at every world size."""

import os

import numpy as np
import pytest

from titanloop.data import DataConfig, SourceConfig
from titanloop.data.locality import read_amplification
from titanloop.data.shard_output import write_shard_set
from titanloop.data.shards import open_shard_sources

SEQ, G, BLOCK, STEPS, VOCAB = 64, 1024, 8, 8, 1000
TOKENIZER = {"fingerprint": "sha1:locality-test", "vocab_size": VOCAB, "eos_id": 0}


@pytest.fixture(scope="module")
def shard_sets(tmp_path_factory):
    """A 70/30 mixture with documents of 300-900 tokens (web-like) in ~8 KB shards (~170: fewer than the 1024
    lanes), enough windows for STEPS steps of G rows. The mixture's lane quotas are fractional (716.8 / 307.2),
    so steps also hand surplus rows between ranks."""
    root = tmp_path_factory.mktemp("locality")
    need = STEPS * G * SEQ * 1.1
    for name, share, seed in (("web", 0.7, 1), ("code", 0.3, 2)):
        rng = np.random.default_rng(seed)

        def docs(budget=int(need * share), rng=rng, name=name):
            i = 0
            while budget > 0:
                n = int(rng.integers(300, 900))
                yield np.append(rng.integers(1, VOCAB, n), 0), f"{name}{i}", 0, {"url": f"https://x/{i}"}
                budget -= n + 1
                i += 1

        write_shard_set(str(root / name), "mds", name, docs(), TOKENIZER, shard_bytes=8000)
    return [SourceConfig(str(root / "web"), 70.0), SourceConfig(str(root / "code"), 30.0)]


def config(sources, **kw):
    return DataConfig(kind="mds", seed=5, shuffle_block=BLOCK, sources=sources, **kw)


def test_read_amplification_at_most_1_1_from_1_to_1024_ranks(shard_sets):
    cfg = config(shard_sets)
    opened = open_shard_sources(cfg, seq_len=SEQ, vocab_size=VOCAB)
    assert 100 < sum(len(s.manifest.shards) for s in opened) < G  # fewer shards than lanes: lanes share shards
    rows, results = {}, {}
    for world in (1, 8, 1024):
        rows[world] = {}
        results[world] = r = read_amplification(
            cfg,
            seq_len=SEQ,
            global_batch_size=G,
            world=world,
            steps=STEPS,
            vocab_size=VOCAB,
            sources=opened,
            rows_out=rows[world],
        )
        print(f"world {world}: amplification {r['amplification']:.3f}, requests {r['requests']}")
        assert r["rows"] == STEPS * G
        assert r["amplification"] <= 1.1, r
    assert rows[1] == rows[8] == rows[1024], "the global sample sequence must not depend on the world size"
    assert sorted(rows[1]) == list(range(STEPS * G))
    # one global batch draws from (nearly) every shard, while one rank's consecutive rows sit within a block
    assert results[1]["distinct_shards_per_global_batch_mean"] >= 0.9 * sum(len(s.manifest.shards) for s in opened)
    assert results[1024]["consecutive_row_distance_tokens_median"] <= BLOCK * SEQ


def test_small_cache_evicts_stays_bounded_and_reads_the_same_rows(shard_sets):
    """1 MiB per source cannot hold one block per lane at one rank with 1024 lanes: blocks are evicted and
    fetched again (amplification rises), memory stays within the budget, the rows are unchanged."""
    big, small = {}, {}
    kw = {"seq_len": SEQ, "global_batch_size": G, "world": 1, "steps": 2, "vocab_size": VOCAB}
    r_big = read_amplification(config(shard_sets), rows_out=big, **kw)
    r_small = read_amplification(config(shard_sets, cache_mb=1), rows_out=small, **kw)
    assert big == small
    assert r_small["cache_evictions"] > 0 and r_small["max_cache_bytes"] <= 1 << 20
    assert r_small["bytes_fetched"] > r_big["bytes_fetched"]


def test_shard_sets_are_written_with_an_index_per_shard(shard_sets):
    from titanloop.data.shards import read_manifest

    m = read_manifest(shard_sets[0].path)
    assert all(s.index and os.path.isfile(os.path.join(shard_sets[0].path, s.index)) for s in m.shards)
    assert sum(s.index_bytes for s in m.shards) < 0.03 * sum(s.bytes for s in m.shards)
