"""training.dtype = bfloat16 as the trainer applies it (engine.parallelize: FSDP2 MixedPrecisionPolicy with bf16
parameters for compute and fp32 gradient reduction), checked by what the step does, not by a log line.

One optimizer step of the trainer's own code (memory_plan.measure_step: loop.forward_objective, engine.backward,
engine.step) runs on rank 0 of a 2-rank fake process group (the dry run's; collectives return at once), on CPU:
- every attention call sees bf16 q/k/v, and the document mask is built for bf16, so on CUDA the model takes the
  fused kernels (flash-attn for plain causal attention, flash varlen with document masking) instead of falling
  back to SDPA / FlexAttention, which it would do for fp32 (the master dtype);
- gradients are reduce-scattered in fp32: the reduce-scatter moves 4 bytes per parameter element for every 2 the
  bf16 all-gather moves (exactly 2x). With the reduction in bf16 (the broken variant, shown below) it is 1x.
Also: count_collective_bytes against a hand count of the same step.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

import titanloop.model.attention as attn_module
import titanloop.model.looplm as looplm_module
import titanloop.parallel.fsdp as fsdp_module
from titanloop.train.config import load_config
from titanloop.train.dry_run import fake_mesh
from titanloop.train.memory_plan import measure_step

REPO = Path(__file__).resolve().parents[1]


def bf16_step(monkeypatch, doc_masking: bool) -> dict:
    cfg = load_config(
        REPO / "train_configs" / "debug.toml",
        [
            "--training.dtype",
            "bfloat16",
            "--training.doc_masking",
            str(doc_masking).lower(),
            "--training.seq_len",
            "32",
            "--training.micro_batch_size",
            "2",
            "--training.global_batch_size",
            "4",
        ],
        world_size=2,
    )
    seen = {"q": Counter(), "mask": Counter()}
    attention, document_mask = looplm_module.attention, looplm_module.document_mask

    def recording_attention(q, k, v, mask, backend="auto"):
        seen["q"][(q.dtype, k.dtype, v.dtype)] += 1
        return attention(q, k, v, mask, backend)

    def recording_document_mask(doc_ids, backend, dtype, *args, **kwargs):
        seen["mask"][dtype] += 1
        return document_mask(doc_ids, backend, dtype, *args, **kwargs)

    monkeypatch.setattr(looplm_module, "attention", recording_attention)
    monkeypatch.setattr(looplm_module, "document_mask", recording_document_mask)
    nbytes: dict = {}
    with fake_mesh(cfg, 2) as mesh:
        # real tensors (fake ones cannot run the data-dependent document boundaries); collectives are no-ops
        measure_step(cfg, mesh, torch.bfloat16, micro_batches=1, fake=False, comm_bytes=nbytes)
    return {**seen, "bytes": nbytes}


@pytest.mark.parametrize("doc_masking", [False, True])
def test_bf16_policy_gives_attention_bf16_and_reduces_gradients_in_fp32(monkeypatch, doc_masking):
    seen = bf16_step(monkeypatch, doc_masking)
    bf16 = torch.bfloat16
    assert set(seen["q"]) == {(bf16, bf16, bf16)}, seen["q"]  # every loop, forward and AC/backward recompute
    if doc_masking:
        assert set(seen["mask"]) == {bf16}, seen["mask"]
        # on CUDA with flash-attn installed that dtype selects flash varlen (fp32 would select FlexAttention)
        monkeypatch.setattr(attn_module, "_flash_attn_varlen_func", object())
        cuda = torch.device("cuda")
        assert attn_module.document_kernel("auto", cuda, bf16) in ("varlen", "flash_varlen")  # fused, in bf16
        assert attn_module.document_kernel("auto", cuda, torch.float32) == "flex"
    else:
        assert not seen["mask"]
        assert bf16 in attn_module._HALF  # the plain path's flash-attn condition (q.is_cuda and q.dtype in _HALF)
    rs, ag = seen["bytes"]["reduce_scatter"], seen["bytes"]["all_gather"]
    assert rs == 2 * ag, seen["bytes"]


def test_collective_bytes_match_a_hand_count(monkeypatch):
    """count_collective_bytes (behind the network-per-step benchmark) against a count by hand of the same step:
    debug.toml's model (vocab 64, hidden 64, ffn 176, 2 layers, untied LM head) at 2 ranks, 1 micro-batch. FSDP2
    pads each parameter's first dimension to a multiple of the 2 ranks and gathers each unit once per step
    (reshard_looped = "never"): the bf16 all-gather carries 2 bytes per padded element, the fp32 reduce-scatter 4.
    (It counted the all-gather twice on the fake backend before: 437,000 bytes, equal to the reduce-scatter.)"""
    h, ffn, vocab = 64, 176, 64
    layer = 4 * h * h + 3 * h * ffn + 4 * h  # q, k, v, o; gate, up, down; 4 sandwich norms
    root = vocab * h + h * vocab + h + 2 * h + 2  # embedding, LM head, final norm, exit gate (1 x h and 1 -> 2 rows)
    elements = root + 2 * layer
    assert (layer, root) == (50432, 8386)
    seen = bf16_step(monkeypatch, doc_masking=False)
    assert dict(seen["bytes"]) == {"all_gather": 2 * elements, "reduce_scatter": 4 * elements}


def test_bf16_gradient_reduction_would_be_caught(monkeypatch):
    """The broken variant: a MixedPrecisionPolicy that reduces in bf16 moves as many reduce-scatter bytes as
    all-gather bytes, which the check above rejects."""
    policy = fsdp_module.MixedPrecisionPolicy

    def bf16_reduce(param_dtype=None, reduce_dtype=None, **kwargs):
        return policy(param_dtype=param_dtype, reduce_dtype=torch.bfloat16, **kwargs)

    monkeypatch.setattr(fsdp_module, "MixedPrecisionPolicy", bf16_reduce)
    seen = bf16_step(monkeypatch, doc_masking=False)
    assert seen["bytes"]["reduce_scatter"] == seen["bytes"]["all_gather"], seen["bytes"]
