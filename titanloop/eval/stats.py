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


def _head_stats(readouts: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_size: int):
    """readouts [T, n, H] (scored tokens), targets [n] -> ce, correct, margin, ash_delta, each [T, n]."""
    t_total, n, _ = readouts.shape
    ce = torch.empty(t_total, n)
    correct = torch.empty(t_total, n, dtype=torch.bool)
    margin = torch.empty(t_total, n)
    ash = torch.full((t_total, n), math.inf)
    for s in range(0, n, chunk_size):
        e = min(n, s + chunk_size)
        prev = None
        for t in range(t_total):
            logits = (readouts[t, s:e] @ weight.t()).float()
            logp = torch.log_softmax(logits, dim=-1)
            p = logp.exp()
            ce[t, s:e] = -logp.gather(1, targets[s:e, None])[:, 0]
            correct[t, s:e] = logits.argmax(-1) == targets[s:e]
            top = p.topk(min(2, p.shape[-1]), dim=-1).values
            margin[t, s:e] = top[:, 0] - (top[:, 1] if top.shape[1] > 1 else 0.0)
            if prev is not None:
                ash[t, s:e] = (p - prev).abs().sum(-1)
            prev = p
    return ce, correct, margin, ash


@torch.no_grad()
def collect_loop_stats(
    model: LoopLM, batches: list[dict], n_loops: int, *, chunk_size: int = 1024, progress=None
) -> LoopStats:
    """Run every batch to `n_loops` loops and gather the per-token, per-loop scalars (module docstring)."""
    require(int(n_loops) >= 1, "n_loops", n_loops, "an integer >= 1")
    require(chunk_size >= 1, "chunk_size", chunk_size, "an integer >= 1")
    device = model.embed_tokens.weight.device
    weight = model.lm_head.weight
    parts = {k: [] for k in ("ce", "correct", "margin", "ash", "hdelta", "gate", "row", "rms")}
    row_offset = 0
    for bi, batch in enumerate(batches):
        ids, labels = batch["input_ids"].to(device), batch["labels"].to(device)
        scored = labels != IGNORE_INDEX
        real = batch["token_mask"].to(device)
        readouts, gates, hdelta, rms = [], [], [], []
        prev = None
        for step in iter_loops(model, ids, n_loops, doc_ids=batch.get("doc_ids")):
            readouts.append(step.exit_readout[scored])
            gates.append(step.gate_logit[scored].float())
            x = step.normed[scored].float()
            hdelta.append(
                torch.full((x.shape[0],), math.inf) if prev is None else (x - prev).pow(2).mean(-1).sqrt().cpu()
            )
            prev = x
            rms.append(step.state[real].float().pow(2).mean(-1).sqrt().cpu())
        ce, correct, margin, ash = _head_stats(torch.stack(readouts), weight, labels[scored], chunk_size)
        parts["ce"].append(ce)
        parts["correct"].append(correct)
        parts["margin"].append(margin)
        parts["ash"].append(ash)
        parts["hdelta"].append(torch.stack(hdelta))
        parts["gate"].append(torch.stack(gates).cpu())
        parts["rms"].append(torch.stack(rms))
        # an example is a row, or a document of a packed row: key = global row * (S + 1) + doc id
        key = torch.arange(ids.shape[0], device=device)[:, None] * (ids.shape[1] + 1) + row_offset
        if batch.get("doc_ids") is not None:
            key = key + batch["doc_ids"].to(device)
        parts["row"].append(key.expand_as(ids)[scored].cpu())
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
