"""Turn what a user hands to the evaluator into a finite list of batches.

Accepted datasets (`eval_batches`):
  - a list of token sequences (lists of ints or 1-D LongTensors): each sequence is scored on next-token
    prediction (input = seq[:-1], target = seq[1:]); rows are right-padded to a batch and padding is masked;
  - one batch dict or a list of batch dicts with `input_ids` [B, S] and `labels` [B, S] (-100 = not scored,
    already shifted: the titanloop.data convention), optionally `doc_ids`;
  - any iterable of such batch dicts (e.g. a titanloop.data loader, which is infinite): the first `max_batches`;
  - a titanloop.data `DataConfig`: kind='synthetic_task' with split='eval' gives held-out examples (one per
    row, labels on the answer tokens); any other kind gives the first `max_batches` training micro-batches.
Every batch gets a `token_mask` [B, S] (real tokens, False on padding) used for hidden-state statistics.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping

import torch

from titanloop.config_errors import ConfigError, require
from titanloop.objectives import IGNORE_INDEX
from titanloop.data.synthetic_tasks import build_task, eval_batches as task_eval_batches
from titanloop.data import build_dataloader

DEFAULT_MAX_BATCHES = 8


def _sequences_to_batches(seqs: list, batch_size: int) -> list[dict]:
    rows = []
    for i, s in enumerate(seqs):
        t = torch.as_tensor(s, dtype=torch.long).flatten()
        if t.numel() < 2:
            raise ConfigError(
                f"dataset[{i}] has {t.numel()} token(s): expected sequences of at least 2 tokens "
                "(an input and a next-token target)"
            )
        rows.append(t)
    batches = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        width = max(r.numel() for r in chunk) - 1
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        labels = torch.full((len(chunk), width), IGNORE_INDEX, dtype=torch.long)
        token_mask = torch.zeros(len(chunk), width, dtype=torch.bool)
        for j, r in enumerate(chunk):
            n = r.numel() - 1
            ids[j, :n], labels[j, :n], token_mask[j, :n] = r[:-1], r[1:], True
        batches.append({"input_ids": ids, "labels": labels, "token_mask": token_mask})
    return batches


def _check_batch(b, i: int) -> dict:
    if not isinstance(b, Mapping) or "input_ids" not in b or "labels" not in b:
        raise ConfigError(f"dataset batch {i} is invalid: expected a dict with 'input_ids' and 'labels' [B, S]")
    ids, labels = torch.as_tensor(b["input_ids"]), torch.as_tensor(b["labels"])
    if ids.dim() != 2 or ids.shape != labels.shape:
        raise ConfigError(
            f"dataset batch {i}: input_ids {list(ids.shape)} and labels {list(labels.shape)} are "
            "invalid: expected two [B, S] tensors of the same shape"
        )
    out = {"input_ids": ids.long(), "labels": labels.long()}
    out["token_mask"] = (
        torch.as_tensor(b["token_mask"]).bool() if "token_mask" in b else torch.ones_like(ids, dtype=torch.bool)
    )
    if b.get("doc_ids") is not None:
        out["doc_ids"] = torch.as_tensor(b["doc_ids"]).long()
    return out


def _data_config_batches(cfg, batch_size: int, n_batches: int, seq_len: int, vocab_size: int | None) -> list[dict]:
    """Batches from a titanloop.data DataConfig: held-out examples for a synthetic task with split='eval'
    (one example per row, labels on the answer), else the first micro-batches of the training loader."""
    require(vocab_size is not None, "vocab_size", vocab_size, "the model's vocab size when dataset is a DataConfig")
    if cfg.kind == "synthetic_task" and cfg.split == "eval":
        options = {k: v for k, v in cfg.task_options.items() if k != "train_size"}
        task = build_task(cfg.task, seed=cfg.seed, **options)
        require(
            task.vocab_size <= vocab_size,
            "model vocab_size",
            vocab_size,
            f">= {task.vocab_size}, the vocabulary of task {cfg.task!r}",
        )
        return list(task_eval_batches(task, n_batches * batch_size, batch_size, seed=cfg.seed))

    loader = build_dataloader(
        cfg,
        seq_len=seq_len,
        micro_batch_size=batch_size,
        global_batch_size=batch_size,
        dp_rank=0,
        dp_world=1,
        vocab_size=vocab_size,
    )
    try:
        return list(itertools.islice(iter(loader), n_batches))
    finally:
        loader.close()


def eval_batches(
    dataset, *, batch_size: int = 8, max_batches: int | None = None, seq_len: int = 256, vocab_size: int | None = None
) -> list[dict]:
    """A finite list of checked batches (see the module docstring); one-line ConfigError on bad input."""
    require(batch_size >= 1, "batch_size", batch_size, "an integer >= 1")
    require(max_batches is None or max_batches >= 1, "max_batches", max_batches, "an integer >= 1 or None")
    if dataset is None:
        raise ConfigError("dataset=None is invalid: expected token sequences, batch dicts, a loader or a DataConfig")
    if type(dataset).__name__ == "DataConfig":
        dataset = _data_config_batches(dataset, batch_size, max_batches or DEFAULT_MAX_BATCHES, seq_len, vocab_size)
    if isinstance(dataset, Mapping):
        dataset = [dataset]
    if isinstance(dataset, torch.Tensor):
        dataset = list(dataset) if dataset.dim() == 2 else [dataset]
    if isinstance(dataset, (list, tuple)):
        items = list(dataset)
        if not items:
            raise ConfigError("dataset is empty: expected at least one token sequence or batch")
        if isinstance(items[0], Mapping):
            batches = [_check_batch(b, i) for i, b in enumerate(items)]
        else:
            batches = _sequences_to_batches(items, batch_size)
    elif isinstance(dataset, Iterable):
        first = itertools.islice(dataset, max_batches or DEFAULT_MAX_BATCHES)
        batches = [_check_batch(b, i) for i, b in enumerate(first)]
    else:
        raise ConfigError(
            f"dataset of type {type(dataset).__name__} is invalid: expected token sequences, batch "
            "dicts, a loader or a DataConfig"
        )
    if max_batches is not None:
        batches = batches[:max_batches]
    if not batches or all(int((b["labels"] != IGNORE_INDEX).sum()) == 0 for b in batches):
        raise ConfigError(
            "dataset is empty: no token has a target (all labels are -100); expected at least one scored token"
        )
    if vocab_size is not None:
        top = max(max(int(b["input_ids"].max()), int(b["labels"].max())) for b in batches)
        low = min(
            int(torch.where(b["labels"] == IGNORE_INDEX, 0, b["labels"]).min().clamp(max=int(b["input_ids"].min())))
            for b in batches
        )
        require(
            0 <= low and top < vocab_size,
            "dataset token id",
            top if top >= vocab_size else low,
            f"ids in [0, {vocab_size}) (the model's vocab_size)",
        )
    return batches
