"""Document masking without a dense [S, S] mask (issue 14): every CPU kernel against today's masked SDPA,
the exact arguments handed to flash-attn's varlen kernel (a fake kernel stands in on CPU), the kernel
choice per device, and RoPE positions per document."""

from __future__ import annotations

import math

import pytest
import torch

from titanloop.model import LoopLM, LoopLMConfig
from titanloop.model import attention as attn

V = 64
# Rows of a packed batch: documents of length 1, a row that is one document, many short documents.
DOC_LENGTHS = [[5, 1, 9, 1], [16], [3, 3, 3, 3, 2, 1, 1]]
S = 16


def doc_ids_from(lengths=DOC_LENGTHS) -> torch.Tensor:
    return torch.tensor([[i for i, n in enumerate(row) for _ in range(n)] for row in lengths])


def qkv(b, h, hkv, s=S, d=8, grad=False):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(b, n, s, d, generator=g, requires_grad=grad) for n in (h, hkv, hkv)]


def dense_reference(q, k, v, doc_ids):
    """Today's path: SDPA with the dense boolean [B, 1, S, S] document mask."""
    return attn.attention(q, k, v, attn.causal_mask(S, S, q.device, doc_ids))


def test_cu_seqlens_and_positions_follow_the_documents():
    doc = doc_ids_from()
    cu = attn.cu_seqlens(doc)
    assert cu.dtype == torch.int32
    flat = [n for row in DOC_LENGTHS for n in row]
    assert cu.tolist() == [0] + torch.tensor(flat).cumsum(0).tolist()
    assert attn.document_positions(doc)[0].tolist() == [0, 1, 2, 3, 4, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 0]
    assert attn.document_positions(doc)[1].tolist() == list(range(S))


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("kernel", ["sdpa_per_doc", "flex"])
@pytest.mark.parametrize("hkv", [4, 2])
def test_every_cpu_kernel_matches_masked_sdpa(kernel, hkv):
    doc = doc_ids_from()
    q, k, v = qkv(len(DOC_LENGTHS), 4, hkv)
    ref = dense_reference(q, k, v, doc)
    mask = attn.document_mask(doc, "auto", q.dtype, kernel=kernel)
    assert isinstance(mask, attn.DocumentMask) and mask.kernel == kernel
    with torch.no_grad():  # FlexAttention has no CPU backward in this torch
        out = attn.attention(q, k, v, mask)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_sdpa_per_doc_gradients_match_masked_sdpa():
    doc = doc_ids_from()
    grads = []
    for mask in (attn.causal_mask(S, S, "cpu", doc), attn.document_mask(doc, "sdpa_per_doc", torch.float32)):
        q, k, v = qkv(len(DOC_LENGTHS), 4, 2, grad=True)
        attn.attention(q, k, v, mask).pow(2).sum().backward()
        grads.append([q.grad, k.grad, v.grad])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_kernel_choice_per_device_and_backend(monkeypatch):
    cpu, cuda, bf16, f32 = torch.device("cpu"), torch.device("cuda"), torch.bfloat16, torch.float32
    monkeypatch.setattr(attn, "_TORCH_VARLEN", None)  # torch's varlen_attn: tests/test_model_attention_varlen.py
    monkeypatch.setattr(attn, "_flash_attn_varlen_func", None)
    assert attn.document_kernel("auto", cpu, f32) == "sdpa_per_doc"  # size unknown: counted as large
    assert attn.document_kernel("auto", cuda, bf16) == "flex"  # no flash-attn: FlexAttention (has a CUDA backward)
    assert attn.document_kernel("sdpa", cuda, bf16) == "dense"
    with pytest.raises(RuntimeError, match="needs flash-attn"):
        attn.document_kernel("flash", cuda, bf16)
    monkeypatch.setattr(attn, "_flash_attn_varlen_func", object())
    assert attn.document_kernel("auto", cuda, bf16) == "flash_varlen"
    assert attn.document_kernel("flash", cuda, bf16) == "flash_varlen"
    assert attn.document_kernel("auto", cuda, f32) == "flex"  # flash-attn is fp16/bf16 only
    assert attn.document_kernel("auto", cpu, bf16) == "sdpa_per_doc"
    assert attn.document_kernel("flex", cpu, f32) == "flex"


def test_cpu_auto_uses_the_dense_mask_up_to_the_threshold_and_per_document_calls_above(monkeypatch):
    """CPU `auto`: one SDPA call with the dense [B, 1, S, S] mask while B*S*S <= DENSE_MASK_MAX_ELEMENTS,
    per-document calls above; both give the masked-SDPA result (forward and gradients)."""
    cpu, f32, limit = torch.device("cpu"), torch.float32, attn.DENSE_MASK_MAX_ELEMENTS
    assert attn.document_kernel("auto", cpu, f32, limit) == "dense"
    assert attn.document_kernel("auto", cpu, f32, limit + 1) == "sdpa_per_doc"
    assert attn.document_kernel("sdpa_per_doc", cpu, f32, 1) == "sdpa_per_doc"  # an explicit backend wins
    assert attn.document_kernel("flex", cpu, f32, 1) == "flex"
    assert attn.document_kernel("auto", torch.device("cuda"), f32, 1) == "flex"  # only CPU uses the size
    doc = doc_ids_from()
    b, s = doc.shape
    outs = {}
    for limit in (b * s * s, b * s * s - 1):  # the batch exactly at the limit, and one element over it
        monkeypatch.setattr(attn, "DENSE_MASK_MAX_ELEMENTS", limit)
        mask = attn.document_mask(doc, "auto", f32)
        kernel = "dense" if isinstance(mask, torch.Tensor) else mask.kernel
        q, k, v = qkv(b, 4, 2, grad=True)
        out = attn.attention(q, k, v, mask)
        out.pow(2).sum().backward()
        outs[kernel] = [out, q.grad, k.grad, v.grad]
    assert set(outs) == {"dense", "sdpa_per_doc"}
    assert outs["dense"][0].shape == (b, 4, s, 8)
    for a, r in zip(outs["dense"], outs["sdpa_per_doc"]):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5)


class FakeVarlen:
    """Stands in for flash_attn.flash_attn_varlen_func: records its arguments, computes attention per
    document from them by hand (so wrong boundaries give wrong outputs)."""

    def __init__(self):
        self.calls = []

    def __call__(self, q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal):
        self.calls.append(
            dict(
                q=q,
                k=k,
                v=v,
                cu_seqlens_q=cu_seqlens_q,
                cu_seqlens_k=cu_seqlens_k,
                max_seqlen_q=max_seqlen_q,
                max_seqlen_k=max_seqlen_k,
                causal=causal,
            )
        )
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out, cu = torch.empty_like(q), cu_seqlens_q.tolist()
        for lo, hi in zip(cu[:-1], cu[1:]):
            scores = torch.einsum("qhd,khd->hqk", q[lo:hi], k[lo:hi]) / math.sqrt(q.shape[-1])
            scores = scores.masked_fill(torch.ones(hi - lo, hi - lo, dtype=torch.bool).triu(1), float("-inf"))
            out[lo:hi] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v[lo:hi])
        return out


def test_flash_varlen_contract_in_the_model(monkeypatch):
    """The LoopLM with doc_ids on the flash path: the varlen kernel gets [B*S, heads, D] tensors, the
    documents' int32 cu_seqlens, max_seqlen = S and causal=True; no dense mask is built; outputs and
    gradients equal the masked-SDPA model."""
    fake = FakeVarlen()
    monkeypatch.setattr(attn, "_flash_attn_varlen_func", fake)
    cfg = LoopLMConfig(
        vocab_size=V, hidden_size=32, n_heads=4, n_kv_heads=2, ffn_hidden_size=64, n_layers=2, n_loops=3, max_seq_len=64
    )
    torch.manual_seed(0)
    ref_model = LoopLM(cfg.replace(attention_backend="sdpa"))
    model = LoopLM(cfg)
    model.load_state_dict(ref_model.state_dict())
    doc = doc_ids_from()
    x = torch.randint(0, V, doc.shape, generator=torch.Generator().manual_seed(1))
    ref = ref_model(x, doc_ids=doc)
    sum(r.pow(2).mean() for r in ref.readouts).backward()

    real_kernel = attn.document_kernel
    monkeypatch.setattr(attn, "document_kernel", lambda *a: "flash_varlen")  # as on CUDA, backend 'flash', bf16
    monkeypatch.setattr(attn, "causal_mask", lambda *a, **k: pytest.fail("a dense mask was built"))
    out = model(x, doc_ids=doc)
    sum(r.pow(2).mean() for r in out.readouts).backward()

    assert len(fake.calls) == cfg.n_layers * cfg.n_loops
    expected_cu = attn.cu_seqlens(doc)
    b, s = doc.shape
    for call in fake.calls:
        assert call["q"].shape == (b * s, 4, 8) and call["k"].shape == call["v"].shape == (b * s, 2, 8)
        assert call["cu_seqlens_q"].dtype == torch.int32 and call["cu_seqlens_q"] is call["cu_seqlens_k"]
        assert torch.equal(call["cu_seqlens_q"], expected_cu)
        assert call["max_seqlen_q"] == call["max_seqlen_k"] == s and call["causal"] is True
        assert all(t.dim() == 3 for t in (call["q"], call["k"], call["v"]))
    for a, r in zip(out.readouts, ref.readouts):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5)
    for (name, p), (_, pr) in zip(model.named_parameters(), ref_model.named_parameters()):
        torch.testing.assert_close(p.grad, pr.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert real_kernel("flash", torch.device("cuda"), torch.bfloat16) == "flash_varlen"  # the fake is importable

    fake.calls.clear()
    with attn.math_attention():  # JSRR's forward-mode AD: flash has none, documents go through SDPA (math)
        model(x, doc_ids=doc)
    assert fake.calls == []


@pytest.mark.parametrize("backend,limit", [("auto", 0), ("sdpa_per_doc", None)])
def test_model_with_documents_on_cpu_matches_masked_sdpa_without_a_dense_mask(monkeypatch, backend, limit):
    if limit is not None:  # `auto` above its dense-mask threshold: per-document calls
        monkeypatch.setattr(attn, "DENSE_MASK_MAX_ELEMENTS", limit)
    cfg = LoopLMConfig(
        vocab_size=V,
        hidden_size=32,
        n_heads=4,
        ffn_hidden_size=64,
        n_layers=1,
        n_loops=2,
        max_seq_len=64,
        attention_backend=backend,
    )
    torch.manual_seed(0)
    model = LoopLM(cfg)
    ref_model = LoopLM(cfg.replace(attention_backend="sdpa"))
    ref_model.load_state_dict(model.state_dict())
    doc = doc_ids_from()
    x = torch.randint(0, V, doc.shape, generator=torch.Generator().manual_seed(1))
    ref = ref_model(x, doc_ids=doc).readouts[-1]
    monkeypatch.setattr(attn, "causal_mask", lambda *a, **k: pytest.fail("a dense mask was built"))
    torch.testing.assert_close(model(x, doc_ids=doc).readouts[-1], ref, rtol=1e-5, atol=1e-5)


def test_model_with_documents_on_cpu_auto_small_batch_uses_one_masked_sdpa_call(monkeypatch):
    """The model under CPU `auto` with a small batch: the dense mask, one SDPA call per layer and loop (no
    per-document calls), equal to the per-document model; under math_attention (JSRR's forward-mode AD)
    a jvp through the dense path equals the per-document one."""
    cfg = LoopLMConfig(
        vocab_size=V, hidden_size=32, n_heads=4, n_kv_heads=2, ffn_hidden_size=64, n_layers=2, n_loops=2, max_seq_len=64
    )
    torch.manual_seed(0)
    model = LoopLM(cfg)
    ref_model = LoopLM(cfg.replace(attention_backend="sdpa_per_doc"))
    ref_model.load_state_dict(model.state_dict())
    doc = doc_ids_from()
    x = torch.randint(0, V, doc.shape, generator=torch.Generator().manual_seed(1))
    ref = ref_model(x, doc_ids=doc).readouts[-1]
    _, _, mask = model.rope_and_mask(x, doc_ids=doc)
    assert isinstance(mask, torch.Tensor) and mask.shape == (doc.shape[0], 1, S, S)
    sdpa_calls = []
    real_sdpa = attn.F.scaled_dot_product_attention
    monkeypatch.setattr(
        attn.F,
        "scaled_dot_product_attention",
        lambda *a, **k: sdpa_calls.append(k.get("attn_mask")) or real_sdpa(*a, **k),
    )
    out = model(x, doc_ids=doc).readouts[-1]
    assert len(sdpa_calls) == cfg.n_layers * cfg.n_loops and all(m is not None for m in sdpa_calls)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)

    h = torch.randn(*doc.shape, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    tangent = torch.randn_like(h)
    jvps = []
    for m in (model, ref_model):
        cos, sin, mask = m.rope_and_mask(x, doc_ids=doc)
        with attn.math_attention():
            jvps.append(torch.func.jvp(lambda z: m.loop_step(z, 0, cos, sin, mask), (h,), (tangent,)))
    for a, r in zip(*jvps):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5)


def test_rope_per_document_changes_only_rounding_under_the_document_mask():
    """RoPE is relative and no query sees another document, so restarting positions per document gives
    the same outputs (the reason it is off by default); without the document mask it would not."""
    cfg = LoopLMConfig(
        vocab_size=V, hidden_size=32, n_heads=4, ffn_hidden_size=64, n_layers=1, n_loops=2, max_seq_len=64
    )
    torch.manual_seed(0)
    model = LoopLM(cfg)
    per_doc = LoopLM(cfg.replace(rope_per_document=True))
    per_doc.load_state_dict(model.state_dict())
    doc = doc_ids_from()
    x = torch.randint(0, V, doc.shape, generator=torch.Generator().manual_seed(1))
    a, b = model(x, doc_ids=doc).readouts[-1], per_doc(x, doc_ids=doc).readouts[-1]
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    cos, _, _ = per_doc.rope_and_mask(x, doc_ids=doc)
    assert cos.shape == (*doc.shape, cfg.head_dim)  # per-row tables: positions restart at documents
    shifted = model(x, positions=attn.document_positions(doc)).readouts[-1]  # plain causal: positions matter
    assert not torch.allclose(shifted, model(x).readouts[-1], atol=1e-3)


def sdpa_calls(monkeypatch) -> list:
    """(attn_mask, is_causal) of every SDPA call from now on, the calls themselves run as before."""
    calls = []
    real_sdpa = attn.F.scaled_dot_product_attention
    monkeypatch.setattr(
        attn.F,
        "scaled_dot_product_attention",
        lambda *a, **k: calls.append((k.get("attn_mask"), k.get("is_causal"))) or real_sdpa(*a, **k),
    )
    return calls


def test_rows_that_are_whole_documents_take_plain_causal_attention(monkeypatch):
    """A batch whose rows never cross a document boundary (a corpus of one long text, or windows cut per document)
    needs no document mask: under `auto` the eager model runs SDPA's causal kernel, one call per layer and loop
    with no mask, bitwise equal to the forward without document ids and close to the per-document model (forward
    and gradients). A row with a boundary still gets its mask, and compiled layers keep theirs."""
    cfg = LoopLMConfig(
        vocab_size=V, hidden_size=32, n_heads=4, ffn_hidden_size=64, n_layers=2, n_loops=2, max_seq_len=64
    )
    torch.manual_seed(0)
    model = LoopLM(cfg)
    ref_model = LoopLM(cfg.replace(attention_backend="sdpa_per_doc"))
    ref_model.load_state_dict(model.state_dict())
    rows = doc_ids_from([[S], [S], [S]]) + torch.arange(3)[:, None]  # three rows, one document each
    x = torch.randint(0, V, rows.shape, generator=torch.Generator().manual_seed(1))
    assert model.rope_and_mask(x, doc_ids=rows)[2] is None
    calls = sdpa_calls(monkeypatch)
    out = model(x, doc_ids=rows).readouts[-1]
    assert calls == [(None, True)] * (cfg.n_layers * cfg.n_loops)
    assert torch.equal(out, model(x).readouts[-1])
    out.pow(2).sum().backward()
    ref = ref_model(x, doc_ids=rows).readouts[-1]
    ref.pow(2).sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for p, r in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-5, atol=1e-5)

    assert model.rope_and_mask(x, doc_ids=doc_ids_from())[2] is not None  # rows with boundaries
    model.compiled_layers = True
    assert model.rope_and_mask(x, doc_ids=rows)[2] is not None


def test_retrofit_rows_that_are_whole_documents_take_plain_causal_attention(monkeypatch):
    """The retrofit model takes the same fast path: rows that are whole documents run SDPA's causal kernel with no
    mask (every layer: prelude, recurrent steps, coda), close to the document-masked forward it replaces (forward
    and gradients); a row with a boundary keeps its mask, and so do compiled layers."""
    from titanloop.retrofit import RetrofitConfig
    from titanloop.retrofit.model import DenseShape, RetrofitLM

    shape = DenseShape(
        vocab_size=V, hidden_size=32, n_heads=4, n_kv_heads=2, head_dim=8, ffn_hidden_size=64, n_layers=4,
        norm_eps=1e-6, rope_theta=10000.0, qkv_bias=True, o_bias=False, mlp_bias=False, tie_embeddings=False,
        max_seq_len=64,
    )  # fmt: skip
    cfg = RetrofitConfig(hf_path="unused", n_prelude=1, recurrent_layer=1, n_coda=1, lora_rank=4, max_loops=4)
    torch.manual_seed(0)
    model = RetrofitLM(shape, cfg)
    with torch.no_grad():  # a live gate and modulation, not their identity init
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ref_model = RetrofitLM(shape, cfg)
    ref_model.load_state_dict(model.state_dict())
    ref_model.compiled_layers = True  # keeps its document mask
    rows = doc_ids_from([[S], [S], [S]]) + torch.arange(3)[:, None]  # three rows, one document each
    x = torch.randint(0, V, rows.shape, generator=torch.Generator().manual_seed(1))
    assert model.rope_and_mask(x, doc_ids=rows)[2] is None
    assert ref_model.rope_and_mask(x, doc_ids=rows)[2] is not None
    assert model.rope_and_mask(x, doc_ids=doc_ids_from())[2] is not None  # rows with boundaries
    calls = sdpa_calls(monkeypatch)
    out = model(x, 3, doc_ids=rows).readouts[-1]
    assert calls == [(None, True)] * (1 + 3 + 1)  # prelude, 3 recurrent steps, coda
    out.pow(2).sum().backward()
    ref = ref_model(x, 3, doc_ids=rows).readouts[-1]
    ref.pow(2).sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for p, r in zip(model.parameters(), ref_model.parameters()):
        if p.grad is not None or r.grad is not None:
            torch.testing.assert_close(p.grad, r.grad, rtol=1e-5, atol=1e-5)
