"""`synthetic_text`: a deterministic, file-free token stream for demos and tests.

Each document repeats a short random motif (2-8 tokens drawn from ids 1..V-1) up to a random length and ends
with EOS (id 0). The first occurrence of a motif is unpredictable and every repetition is predictable by copying,
so a small model's loss falls quickly and visibly (an induction-head task). Row k is generated from the seed
sequence (seed, k) alone: random access, identical on every rank and after any resume.

V is the model's vocabulary, or `motif_vocab` ([data] motif_vocab) when set: motifs then use only ids
1..motif_vocab-1 of a larger vocabulary, so a large model (the 49K-token Ouro shape) learns the task in a few
hundred steps of a GPU run. `entropy_floor` is a lower bound on the cross-entropy any predictor reaches.
"""

from __future__ import annotations

import numpy as np

from titanloop.config_errors import require
from titanloop.data.packing import PackedRow

EOS_ID = 0


class SyntheticTextSource:
    name = "synthetic_text"

    def __init__(self, seq_len: int, vocab_size: int, seed: int, max_doc_len: int = 256, motif_vocab: int = 0):
        require(vocab_size >= 16, "vocab_size", vocab_size, "an integer >= 16 for synthetic_text")
        require(
            motif_vocab == 0 or 16 <= motif_vocab <= vocab_size,
            "data.motif_vocab",
            motif_vocab,
            f"0 (the model's vocabulary) or an integer in [16, model.vocab_size={vocab_size}]",
        )
        self.seq_len, self.vocab_size, self.seed = seq_len, vocab_size, seed
        self.max_doc_len = max_doc_len
        self.motif_vocab = motif_vocab or vocab_size

    def epoch_of(self, samples: int) -> int:
        return 0  # an infinite stream

    def row(self, k: int) -> PackedRow:
        rng = np.random.default_rng([self.seed, k])
        length = self.seq_len + 1
        tokens = np.empty(length, dtype=np.int64)
        doc_ids = np.empty(length, dtype=np.int64)
        pos, doc = 0, 0
        while pos < length:
            motif = rng.integers(1, self.motif_vocab, size=int(rng.integers(2, 9)))
            n = int(rng.integers(2 * len(motif), self.max_doc_len + 1))
            body = np.append(np.resize(motif, n), EOS_ID)[: length - pos]
            tokens[pos : pos + len(body)] = body
            doc_ids[pos : pos + len(body)] = doc
            pos += len(body)
            doc += 1
        return PackedRow(tokens, doc_ids, np.ones(length, dtype=bool))

    def entropy_floor(self, rows: int = 64) -> float:
        """A lower bound (nats per predicted token) on the cross-entropy of any predictor of this stream, estimated
        over its first `rows` rows: every motif's first occurrence is drawn uniformly and independently of
        everything before it, so no predictor pays less than ln(V - 1) on those tokens (and it pays more than 0
        on the others: EOS and motif-length uncertainty are not counted, which keeps this a lower bound)."""
        unpredictable = predicted = 0
        for k in range(rows):
            rng = np.random.default_rng([self.seed, k])
            pos, first = 0, True
            while pos < self.seq_len + 1:
                m = int(rng.integers(2, 9))
                rng.integers(1, self.motif_vocab, size=m)  # the same draws as row()
                n = int(rng.integers(2 * m, self.max_doc_len + 1))
                # labels are the row's tokens 1..seq_len: the row's very first token is never predicted
                unpredictable += max(0, min(m, self.seq_len + 1 - pos) - (1 if first else 0))
                pos += n + 1
                first = False
            predicted += self.seq_len
        return unpredictable * float(np.log(self.motif_vocab - 1)) / predicted
