"""Per-token, per-loop quantities that the depth sweep, the exit strategies and the diagnostics all read.

One pass over the data runs the model to `n_loops` loops (titanloop.eval.trace) and keeps, for every scored
token n and loop t, only scalars: CE, argmax-correct, probability margin, the ASH change and the hidden-state
change. The LM head is applied to chunks of `chunk_size` tokens, loop after loop, so at most two
[chunk_size, vocab] probability tensors exist at any time — never T full-vocabulary tensors.

Definitions (t = 1..T, p_t = softmax of loop t's exit logits):
    ce[t, n]           -log p_t(target)
    correct[t, n]      argmax p_t == target
    margin[t, n]       p_t(top-1) - p_t(top-2)          in [0, 1]   (logit-margin exit; probability form)
    ash_delta[t, n]    ||p_t - p_{t-1}||_1               in [0, 2]   (ASH, dice §2); +inf at t = 1
    hidden_delta[t, n] ||x_t - x_{t-1}||_2 / sqrt(H)     RMS change of the final-normed state (ouro §5.4.1);
                                                          +inf at t = 1
    gate_logits[t, n]  exit-gate logit z_t
    state_rms[t]       RMS of the raw state H_t for every real token (scale diagnostics, readout §4)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from titanloop.config_errors import require
from titanloop.eval.trace import iter_loops
from titanloop.model import LoopLM
from titanloop.objectives import IGNORE_INDEX


@dataclass
class LoopStats:
    ce: torch.Tensor  # [T, N] float32
    correct: torch.Tensor  # [T, N] bool
    margin: torch.Tensor  # [T, N]
    ash_delta: torch.Tensor  # [T, N]
    hidden_delta: torch.Tensor  # [T, N]
    gate_logits: torch.Tensor  # [T, N]
    row: torch.Tensor  # [N] long: which example each scored token belongs to (a row, or a document of a row)
    n_rows: int  # number of examples
    state_rms: torch.Tensor  # [T, M] float32 over the M real (unpadded) tokens

    @property
    def n_loops(self) -> int:
        return self.ce.shape[0]

    @property
    def n_tokens(self) -> int:
        return self.ce.shape[1]

    def quality(self, exit_loop: torch.Tensor) -> dict:
        """Quality when token n exits at loop exit_loop[n] (1-based): loss, perplexity, accuracies, loops used."""
        idx = (exit_loop.long() - 1).clamp(0, self.n_loops - 1)[None]
        ce = self.ce.gather(0, idx)[0]
        correct = self.correct.gather(0, idx)[0]
        wrong = torch.zeros(self.n_rows).index_add_(0, self.row, (~correct).float())
        scored = torch.zeros(self.n_rows).index_add_(0, self.row, torch.ones_like(ce))
        loss = float(ce.mean())
        return {
            "avg_loops": float(exit_loop.float().mean()),
            "loss": loss,
            "perplexity": math.exp(min(loss, 80.0)),
            "token_accuracy": float(correct.float().mean()),
            # exact match: every scored token of the example right (the answer accuracy of synthetic tasks)
            "sequence_accuracy": float((wrong[scored > 0] == 0).float().mean()),
        }


HEAD_FIELDS = ("ce", "correct", "margin", "ash")  # the rows of `_head_stats`'s result
BATCH_FIELDS = (*HEAD_FIELDS, "hdelta", "gate")  # the rows of `batch_stats`'s per-token result


def _head_stats(readouts: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """readouts [T, n, H] (scored tokens), targets [n] -> [4, T, n] float32 on the readouts' device: the rows
    HEAD_FIELDS = ce, correct (1.0 / 0.0), margin, ash_delta (`unpack_head_stats` splits them).

    Everything stays on the device: no host copy and no sync inside the chunk and loop loops; the caller copies
    the result to the CPU once per batch. The per-element arithmetic is the same as when each chunk was copied
    into CPU tensors, so on the CPU the numbers are bitwise those of that version (tests/test_eval_device.py)."""
    t_total, n, _ = readouts.shape
    out = torch.empty(len(HEAD_FIELDS), t_total, n, device=readouts.device)
    out[3, 0] = math.inf  # no change before loop 1
    for s in range(0, n, chunk_size):
        e = min(n, s + chunk_size)
        prev = None
        for t in range(t_total):
            logits = (readouts[t, s:e] @ weight.t()).float()
            logp = torch.log_softmax(logits, dim=-1)
            p = logp.exp()
            out[0, t, s:e] = -logp.gather(1, targets[s:e, None])[:, 0]
            out[1, t, s:e] = logits.argmax(-1) == targets[s:e]
            top = p.topk(min(2, p.shape[-1]), dim=-1).values
            out[2, t, s:e] = top[:, 0] - (top[:, 1] if top.shape[1] > 1 else 0.0)
            if prev is not None:
                out[3, t, s:e] = (p - prev).abs().sum(-1)
            prev = p
    return out


def unpack_head_stats(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """[>= 4, T, n] (rows HEAD_FIELDS first) -> ce, correct (bool), margin, ash_delta, each [T, n]."""
    return packed[0], packed[1] > 0.5, packed[2], packed[3]


def scored_index(labels: torch.Tensor) -> torch.Tensor:
    """Flat indices of the scored tokens of labels [B, S], in row-major order (that of labels[labels != -100])."""
    return (labels != IGNORE_INDEX).flatten().nonzero().squeeze(1)


def take_tokens(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [B, S, ...] at the flat token indices `index` -> [n, ...] (= x[mask] for the mask `index` lists)."""
    return x.flatten(0, 1).index_select(0, index)


def batch_stats(model: LoopLM, batch: dict, n_loops: int, chunk_size: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch on the model's device -> (per scored token [6, T, n] float32 with rows BATCH_FIELDS,
    state_rms [T, m] over the m real tokens), both still on the device.

    Nothing here copies from the device to the host or reads a device value (a model on the meta device runs
    it, and meta tensors refuse both): the token indices are computed from the batch's CPU tensors and copied to
    the device once per batch, with the batch, and every loop's quantities are written into device tensors."""
    device = model.embed_tokens.weight.device
    ids = batch["input_ids"].to(device)
    scored = scored_index(batch["labels"]).to(device)
    real = batch["token_mask"].flatten().nonzero().squeeze(1).to(device)
    doc_ids = batch["doc_ids"].to(device) if batch.get("doc_ids") is not None else None
    targets = batch["labels"].to(device).flatten().index_select(0, scored)
    n = scored.numel()
    per_token = torch.empty(len(BATCH_FIELDS), n_loops, n, device=device)
    rms = torch.empty(n_loops, real.numel(), device=device)
    readouts = []
    prev = None
    for step in iter_loops(model, ids, n_loops, doc_ids=doc_ids):
        t = step.t - 1
        readouts.append(take_tokens(step.exit_readout, scored))
        per_token[5, t] = take_tokens(step.gate_logit, scored).float()
        x = take_tokens(step.normed, scored).float()
        per_token[4, t] = math.inf if prev is None else (x - prev).pow(2).mean(-1).sqrt()
        prev = x
        rms[t] = take_tokens(step.state, real).float().pow(2).mean(-1).sqrt()
    per_token[: len(HEAD_FIELDS)] = _head_stats(torch.stack(readouts), model.lm_head.weight, targets, chunk_size)
    return per_token, rms


@torch.no_grad()
def collect_loop_stats(
    model: LoopLM, batches: list[dict], n_loops: int, *, chunk_size: int = 1024, progress=None
) -> LoopStats:
    """Run every batch to `n_loops` loops and gather the per-token, per-loop scalars (module docstring).

    Each batch is computed on the model's device (`batch_stats`) and copied to the CPU in one transfer."""
    require(int(n_loops) >= 1, "n_loops", n_loops, "an integer >= 1")
    require(chunk_size >= 1, "chunk_size", chunk_size, "an integer >= 1")
    parts = {k: [] for k in (*BATCH_FIELDS, "row", "rms")}
    row_offset = 0
    for bi, batch in enumerate(batches):
        per_token, rms = batch_stats(model, batch, n_loops, chunk_size)
        flat = torch.cat([per_token.flatten(), rms.flatten()]).cpu()  # the batch's one device-to-host copy
        per_token, rms = flat[: per_token.numel()].view(per_token.shape), flat[per_token.numel() :].view(rms.shape)
        ce, correct, margin, ash = unpack_head_stats(per_token)
        for k, v in zip(BATCH_FIELDS, (ce, correct, margin, ash, per_token[4], per_token[5])):
            parts[k].append(v)
        parts["rms"].append(rms)
        # an example is a row, or a document of a packed row: key = global row * (S + 1) + doc id (CPU tensors)
        ids, scored = batch["input_ids"], batch["labels"] != IGNORE_INDEX
        key = torch.arange(ids.shape[0])[:, None] * (ids.shape[1] + 1) + row_offset
        if batch.get("doc_ids") is not None:
            key = key + batch["doc_ids"]
        parts["row"].append(key.expand_as(ids)[scored])
        row_offset += ids.shape[0] * (ids.shape[1] + 1)
        if progress is not None:
            progress(f"batch {bi + 1}/{len(batches)}: {int(scored.sum())} scored tokens, {n_loops} loops")
    row = torch.unique(torch.cat(parts["row"]), return_inverse=True)[1]
    return LoopStats(
        ce=torch.cat(parts["ce"], 1),
        correct=torch.cat(parts["correct"], 1),
        margin=torch.cat(parts["margin"], 1),
        ash_delta=torch.cat(parts["ash"], 1),
        hidden_delta=torch.cat(parts["hdelta"], 1),
        gate_logits=torch.cat(parts["gate"], 1),
        row=row,
        n_rows=int(row.max()) + 1 if row.numel() else 0,
        state_rms=torch.cat(parts["rms"], 1),
    )
