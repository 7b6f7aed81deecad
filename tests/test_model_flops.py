"""LoopLMConfig.flops_per_token (the one FLOP count behind MFU) against torch.utils.flop_counter.

The counter counts every matmul a LoopLM runs (all T loops, the per-loop LM head, the exit gate, prelude/coda
layers, the recurrence gate). SDPA runs with PyTorch's math kernel, whose batched matmuls (aten.bmm, the only
bmm in the model) compute the full square of scores of each call; our count takes only the attended
(unmasked) scores, so the counter's attention FLOPs are scaled by the fraction of computed scores the
causal/document mask keeps, measured from the real mask tensor.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from titanloop.model import LoopLM, LoopLMConfig
from titanloop.model import config as config_module
from titanloop.model.attention import causal_mask, cu_seqlens, document_kernel

B, S = 2, 24
DOCS = [[7, 1, 16], [24]]


def counted(cfg, n_loops, doc_ids, training):
    torch.manual_seed(0)
    model = LoopLM(cfg)
    x = torch.randint(0, cfg.vocab_size, (B, S), generator=torch.Generator().manual_seed(1))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        out = model(x, n_loops, doc_ids=doc_ids, return_logits="all")
        if training:
            (out.logits.float().pow(2).mean() + out.gate_logits.pow(2).mean()).backward()
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    attention = counts.pop("aten.bmm")
    assert set(counts) <= {"aten.mm", "aten.addmm"}, counts
    return attention, sum(counts.values())


def kept_fraction(doc_ids):
    """Unmasked scores / scores the kernel computes: causal SDPA over the row (None); with documents, what the CPU
    kernel of `attention_backend = "auto"` computes: the whole [S, S] square per row with the dense mask (small
    batches, like this one) or each document's square with SDPA per document."""
    if doc_ids is None:
        return (S + 1) / (2 * S)
    kept = causal_mask(S, S, "cpu", doc_ids).sum().item()
    if document_kernel("auto", torch.device("cpu"), torch.float32, doc_ids.shape[0] * S * S) == "dense":
        computed = doc_ids.shape[0] * S * S
    else:
        computed = sum(n * n for n in cu_seqlens(doc_ids).diff().tolist())
    return kept / computed


@pytest.mark.parametrize(
    "variant",
    [
        dict(),
        dict(n_kv_heads=2, gated_recurrence=True),
        dict(n_prelude_layers=1, n_coda_layers=1, tie_embeddings=True),
    ],
)
@pytest.mark.parametrize("docs", [False, True])
@pytest.mark.parametrize("training", [False, True])
def test_flops_per_token_matches_flop_counter(variant, docs, training):
    cfg = LoopLMConfig(
        vocab_size=256, hidden_size=64, n_heads=4, ffn_hidden_size=160, n_layers=2, n_loops=3, max_seq_len=64, **variant
    )
    doc_ids = torch.tensor([[i for i, n in enumerate(row) for _ in range(n)] for row in DOCS]) if docs else None
    n_loops = 3
    attention, other = counted(cfg, n_loops, doc_ids, training)
    expected = other + attention * kept_fraction(doc_ids)
    lengths = [n for row in DOCS for n in row] if docs else None
    ours = cfg.flops_per_token(S, n_loops=n_loops, training=training, doc_lengths=lengths) * B * S
    # exact (measured: 0 relative difference in all 12 cases); 1e-9 only absorbs float rounding of the fraction
    assert ours == pytest.approx(expected, rel=1e-9), (ours, expected, attention, other)
    # broken counts this must catch: attention left out (2.2-3.0% of the FLOPs here, so a 2% band passed some
    # of them), or the LM head counted once instead of at every decoded loop
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(config_module, "attended_keys_per_token", lambda *a, **k: 0.0)
        no_attention = cfg.flops_per_token(S, n_loops=n_loops, training=training, doc_lengths=lengths) * B * S
    one_readout = cfg.flops_per_token(S, n_loops=n_loops, readouts=1, training=training, doc_lengths=lengths) * B * S
    for broken in (no_attention, one_readout):
        assert broken != pytest.approx(expected, rel=1e-3), (broken, expected)


def test_document_masking_counts_fewer_attention_flops_than_causal():
    cfg = LoopLMConfig(vocab_size=256, hidden_size=64, n_heads=4, ffn_hidden_size=160, n_layers=2, max_seq_len=64)
    causal = cfg.flops_per_token(4096, n_loops=4)
    docs = cfg.flops_per_token(4096, n_loops=4, doc_lengths=[1024] * 4)
    assert docs < causal
    # the attention term alone scales with the attended keys: 4096 causal vs four 1024-token documents
    no_attn = causal - 3 * 4 * 2 * 2 * 2 * 64 * (4096 + 1) / 2
    assert (docs - no_attn) / (causal - no_attn) == pytest.approx((1024 + 1) / (4096 + 1))


def test_trainer_mfu_counts_the_documents_of_the_batch():
    """The trainer's MFU (titanloop.train.callbacks.Metrics) counts attention over the packed documents of the
    step's batches (document_lengths of the CPU batch), not over the full causal square."""
    from titanloop.model.attention import document_lengths
    from titanloop.model.config import attended_keys_per_token

    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [5, 5, 5, 5, 5, 5, 5, 5]])
    lengths = document_lengths(doc_ids)
    assert lengths == [3, 2, 3, 8]
    assert attended_keys_per_token(8, lengths) == (6 + 3 + 6 + 36) / 16 < attended_keys_per_token(8) == 4.5
    from titanloop.model import preset

    cfg = preset("debug-tiny")
    assert cfg.flops_per_token(8, doc_lengths=lengths) < cfg.flops_per_token(8)
