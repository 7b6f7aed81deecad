"""`synthetic_text`: a deterministic, file-free token stream for demos and tests.

Each document repeats a short random motif (2-8 tokens drawn from the vocabulary) up to a random length and
ends with EOS (id 0). The first occurrence of a motif is unpredictable and every repetition is predictable
by copying, so a small model's loss falls quickly and visibly (an induction-head task). Row k is generated
from the seed sequence (seed, k) alone: random access, identical on every rank and after any resume.
"""

from __future__ import annotations

import numpy as np

from titanloop.config_errors import require
from titanloop.data.packing import PackedRow

EOS_ID = 0


class SyntheticTextSource:
    name = "synthetic_text"

    def __init__(self, seq_len: int, vocab_size: int, seed: int, max_doc_len: int = 256):
        require(vocab_size >= 16, "vocab_size", vocab_size, "an integer >= 16 for synthetic_text")
        self.seq_len, self.vocab_size, self.seed = seq_len, vocab_size, seed
        self.max_doc_len = max_doc_len

    def epoch_of(self, samples: int) -> int:
        return 0  # an infinite stream

    def row(self, k: int) -> PackedRow:
        rng = np.random.default_rng([self.seed, k])
        length = self.seq_len + 1
        tokens = np.empty(length, dtype=np.int64)
        doc_ids = np.empty(length, dtype=np.int64)
        pos, doc = 0, 0
        while pos < length:
            motif = rng.integers(1, self.vocab_size, size=int(rng.integers(2, 9)))
            n = int(rng.integers(2 * len(motif), self.max_doc_len + 1))
            body = np.append(np.resize(motif, n), EOS_ID)[: length - pos]
            tokens[pos : pos + len(body)] = body
            doc_ids[pos : pos + len(body)] = doc
            pos += len(body)
            doc += 1
        return PackedRow(tokens, doc_ids, np.ones(length, dtype=bool))
