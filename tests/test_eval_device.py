"""titanloop.eval on a chosen device (issue 36): per-token statistics without per-chunk host copies.

The statistics are bitwise those of the version that copied every chunk into CPU tensors (its code is kept
below as the reference), and one batch runs on the meta device, which refuses any copy to the host.
"""

from __future__ import annotations

import math

import pytest
import torch

from titanloop.eval import eval_batches
from titanloop.eval.stats import LoopStats, _head_stats, batch_stats, collect_loop_stats
from titanloop.eval.trace import iter_loops
from titanloop.model import LoopLM, preset
from titanloop.objectives import IGNORE_INDEX

STAT_FIELDS = ("ce", "correct", "margin", "ash_delta", "hidden_delta", "gate_logits", "row", "state_rms")


# ----- the statistics as computed before issue 36 (every chunk copied into CPU tensors): the reference ---------
def old_head_stats(readouts, weight, targets, chunk_size):
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
def old_collect_loop_stats(model, batches, n_loops, *, chunk_size=1024, progress=None):
    device = model.embed_tokens.weight.device
    weight = model.lm_head.weight
    parts = {k: [] for k in ("ce", "correct", "margin", "ash", "hdelta", "gate", "row", "rms")}
    row_offset = 0
    for batch in batches:
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
        ce, correct, margin, ash = old_head_stats(torch.stack(readouts), weight, labels[scored], chunk_size)
        parts["ce"].append(ce)
        parts["correct"].append(correct)
        parts["margin"].append(margin)
        parts["ash"].append(ash)
        parts["hdelta"].append(torch.stack(hdelta))
        parts["gate"].append(torch.stack(gates).cpu())
        parts["rms"].append(torch.stack(rms))
        key = torch.arange(ids.shape[0], device=device)[:, None] * (ids.shape[1] + 1) + row_offset
        if batch.get("doc_ids") is not None:
            key = key + batch["doc_ids"].to(device)
        parts["row"].append(key.expand_as(ids)[scored].cpu())
        row_offset += ids.shape[0] * (ids.shape[1] + 1)
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


def ragged_batches(vocab=64, n=11, seed=0) -> list[dict]:
    """Rows of different lengths (padding, so token_mask matters), and one packed batch with documents."""
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, vocab, (int(torch.randint(4, 40, (1,), generator=g)),), generator=g) for _ in range(n)]
    batches = eval_batches(seqs, batch_size=4)
    ids = batches[0]["input_ids"]
    batches[0]["doc_ids"] = (torch.arange(ids.shape[1]) // 9).expand_as(ids).contiguous()
    return batches


@pytest.mark.parametrize("chunk_size", [1, 7, 1024])
@pytest.mark.parametrize("overrides", [{}, {"readout": "final_only_norm", "n_coda_layers": 1}])
def test_stats_are_bitwise_the_per_chunk_copy_version(chunk_size, overrides):
    torch.manual_seed(0)
    model = LoopLM(preset("debug-tiny", vocab_size=64, n_layers=2, **overrides)).eval()
    with torch.no_grad():
        model.early_exit_gate.weight.normal_(0, 1.0)
    batches = ragged_batches()
    new = collect_loop_stats(model, batches, 5, chunk_size=chunk_size)
    old = old_collect_loop_stats(model, batches, 5, chunk_size=chunk_size)
    assert new.n_rows == old.n_rows and new.n_tokens == old.n_tokens > 0
    for name in STAT_FIELDS:
        a, b = getattr(new, name), getattr(old, name)
        assert a.device.type == "cpu" and a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), f"{name} differs from the per-chunk-copy version"


def test_one_batch_runs_on_the_device_without_host_copies():
    """A model on the meta device: any .cpu(), .item(), float(...), bool(...) or copy into a CPU tensor of a meta
    tensor raises, so this runs only if the statistics stay on the device until the caller's one copy per batch.
    (The version that wrote every chunk into CPU tensors raises here: 'Cannot copy out of meta tensor'.)"""
    with torch.device("meta"):
        model = LoopLM(preset("debug-tiny", vocab_size=64, n_layers=2))
    batch = ragged_batches()[0]
    n_scored = int((batch["labels"] != IGNORE_INDEX).sum())
    per_token, rms = batch_stats(model, batch, 4, chunk_size=5)
    assert per_token.device.type == "meta" and per_token.shape == (6, 4, n_scored)
    assert rms.device.type == "meta" and rms.shape == (4, int(batch["token_mask"].sum()))
    args = (
        torch.empty(3, 40, 16, device="meta"),
        torch.empty(64, 16, device="meta"),
        torch.zeros(40, dtype=torch.long, device="meta"),
        7,
    )
    head = _head_stats(*args)
    assert head.device.type == "meta" and head.shape == (4, 3, 40)
    with pytest.raises(NotImplementedError, match="meta"):  # the reference version copies every chunk to the host
        old_head_stats(*args)
