"""synthetic_text's motif sub-vocabulary (data.motif_vocab) and its entropy floor."""

from __future__ import annotations

import math

import numpy as np
import pytest

from titanloop.config_errors import ConfigError
from titanloop.data import DataConfig, build_dataloader
from titanloop.data.synthetic_text import EOS_ID, SyntheticTextSource


def _row_before_motif_vocab(seq_len: int, vocab: int, seed: int, k: int, max_doc_len: int = 256) -> np.ndarray:
    """The generator as it was before motif_vocab existed (motifs from the whole vocabulary)."""
    rng = np.random.default_rng([seed, k])
    out, pos = [], 0
    while pos < seq_len + 1:
        motif = rng.integers(1, vocab, size=int(rng.integers(2, 9)))
        n = int(rng.integers(2 * len(motif), max_doc_len + 1))
        body = np.append(np.resize(motif, n), EOS_ID)[: seq_len + 1 - pos]
        out.append(body)
        pos += len(body)
    return np.concatenate(out)


def test_the_default_keeps_every_row():
    src = SyntheticTextSource(512, 1000, seed=3)
    for k in (0, 1, 17):
        assert np.array_equal(src.row(k).tokens, _row_before_motif_vocab(512, 1000, 3, k))


def test_motifs_use_the_sub_vocabulary_of_a_large_vocabulary():
    src = SyntheticTextSource(4096, 49152, seed=0, motif_vocab=64)
    tokens = np.concatenate([src.row(k).tokens for k in range(4)])
    assert tokens.max() < 64 and len(set(tokens.tolist()) - {EOS_ID}) > 50
    loader = build_dataloader(
        DataConfig(kind="synthetic_text", motif_vocab=64, prefetch=0),
        seq_len=256,
        micro_batch_size=2,
        global_batch_size=2,
        dp_rank=0,
        dp_world=1,
        vocab_size=49152,
    )
    try:
        assert int(next(iter(loader))["input_ids"].max()) < 64
    finally:
        loader.close()
    for bad in (8, 50000):
        with pytest.raises(ConfigError, match=r"^data\.motif_vocab=\d+ is invalid"):
            SyntheticTextSource(256, 49152, seed=0, motif_vocab=bad)


def test_entropy_floor_counts_the_first_occurrences():
    """The floor is ln(V - 1) per motif token drawn, over the predicted tokens; recounted here from the rows
    themselves: each document's first len(motif) tokens, read as the document's shortest period (the motif length,
    or less when a motif happens to repeat itself, e.g. [a, b, a, b]: the recount is then a little lower)."""
    src = SyntheticTextSource(1024, 49152, seed=0, motif_vocab=64)
    floor = src.entropy_floor(rows=16)
    drawn = 0
    for k in range(16):
        row = src.row(k)
        docs = np.split(row.tokens, np.flatnonzero(np.diff(row.doc_ids)) + 1)
        for i, doc in enumerate(docs):
            body = doc[doc != EOS_ID] if doc[-1] == EOS_ID else doc
            period = next(p for p in range(1, len(body) + 1) if np.array_equal(body[p:], body[: len(body) - p]))
            drawn += min(period, 8) - (1 if i == 0 else 0)  # the row's first token is never predicted
    recount = drawn * math.log(63) / (16 * 1024)
    assert recount <= floor <= 1.02 * recount, (floor, recount)
    whole = SyntheticTextSource(1024, 49152, seed=0).entropy_floor(rows=16)
    assert whole == pytest.approx(floor * math.log(49151) / math.log(63))  # the same draws, a larger alphabet
