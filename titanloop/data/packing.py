"""Packed rows: the unit every source produces and the loader batches.

A row is `seq_len + 1` consecutive tokens of a source's stream; the model input is `tokens[:-1]` and the
next-token targets are `tokens[1:]`, so every token is predicted exactly once across consecutive rows.
`doc_ids` keeps document boundaries (attention can be restricted to a document) and `targets` says which
tokens may be predicted (False for prompts of synthetic tasks, padding and masked-out rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

IGNORE_INDEX = -100


@dataclass
class PackedRow:
    tokens: np.ndarray  # int64 [seq_len + 1]
    doc_ids: np.ndarray  # int64 [seq_len + 1], non-decreasing document index
    targets: np.ndarray  # bool [seq_len + 1], token may be a training target


def rows_to_batch(rows: list[PackedRow], sample_ids: list[int]) -> dict[str, torch.Tensor]:
    """Stack rows into the trainer's micro-batch: shifted labels (-100 = ignore), per-row document index."""
    tokens = np.stack([r.tokens for r in rows])
    doc_ids = np.stack([r.doc_ids for r in rows])
    targets = np.stack([r.targets for r in rows])
    labels = np.where(targets[:, 1:], tokens[:, 1:], IGNORE_INDEX)
    doc_ids = doc_ids[:, :-1] - doc_ids[:, :1]  # document index within the row, starting at 0
    return {
        "input_ids": torch.from_numpy(np.ascontiguousarray(tokens[:, :-1], dtype=np.int64)),
        "labels": torch.from_numpy(np.ascontiguousarray(labels, dtype=np.int64)),
        "doc_ids": torch.from_numpy(np.ascontiguousarray(doc_ids, dtype=np.int64)),
        "sample_ids": torch.tensor(sample_ids, dtype=torch.int64),
    }


def pack_documents(docs: list[tuple[np.ndarray, int]], length: int, pad_id: int) -> PackedRow:
    """Concatenate (tokens, n_prompt_tokens) documents into one row of `length` tokens, padding the tail.

    Documents must fit; the prompt part of each document and the padding are not targets.
    """
    tokens = np.full(length, pad_id, dtype=np.int64)
    doc_ids = np.empty(length, dtype=np.int64)
    targets = np.zeros(length, dtype=bool)
    pos = 0
    for i, (doc, n_prompt) in enumerate(docs):
        n = len(doc)
        tokens[pos : pos + n] = doc
        doc_ids[pos : pos + n] = i
        targets[pos + n_prompt : pos + n] = True
        pos += n
    assert pos <= length, "documents overflow the row"
    doc_ids[pos:] = len(docs)
    return PackedRow(tokens, doc_ids, targets)
