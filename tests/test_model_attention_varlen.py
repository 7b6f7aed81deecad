"""Document-masked attention through torch's varlen_attn (the CUDA path, issue 29), run on CPU with the
reference kernel of titanloop.model.varlen_cpu: values and gradients against the dense-mask SDPA reference,
the kernel choice, and the compiled looped layer (fullgraph=True: no graph break, no recompilation across
loop counts and document counts)."""

from __future__ import annotations

import pytest
import torch

from titanloop.model import LoopLM, LoopLMConfig, varlen_cpu
from titanloop.model import attention as attn
from titanloop.parallel.compile import apply_compile, fullgraph_check

if varlen_cpu.unavailable_reason() is not None:  # pragma: no cover - torch 2.14.1 is pinned
    pytest.skip(f"varlen_cpu cannot register: {varlen_cpu.unavailable_reason()}", allow_module_level=True)

V, S = 64, 16
# documents of length 1, a row that is one document, many short documents (12 documents)
DOCS = torch.tensor([[0] * 5 + [1] + [2] * 9 + [3], [0] * 16, [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 5, 6]])
# the same batch shape with other document counts (4 and 24)
OTHER_DOCS = [torch.tensor([[0] * 16, [0] * 8 + [1] * 8, [0] * 16]), torch.tensor([[i // 2 for i in range(S)]] * 3)]


@pytest.fixture(autouse=True)
def cpu_varlen():
    assert varlen_cpu.register()


def qkv(h, hkv, d=8):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(DOCS.shape[0], n, S, d, generator=g, requires_grad=True) for n in (h, hkv, hkv)]


@pytest.mark.parametrize("hkv", [4, 2])
def test_varlen_values_and_gradients_match_the_dense_mask(hkv):
    results = []
    for mask in (attn.causal_mask(S, S, "cpu", DOCS), attn.document_mask(DOCS, "varlen", torch.float32)):
        q, k, v = qkv(4, hkv)
        out = attn.attention(q, k, v, mask)
        (out.pow(2).sum() + out.sum()).backward()
        results.append([out, q.grad, k.grad, v.grad])
    assert results[1][0].shape == (DOCS.shape[0], 4, S, 8)
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_varlen_is_the_custom_op_and_cu_seqlens_is_dynamic(monkeypatch):
    """The varlen kernel calls torch.ops.torch_attn._varlen_attn (what the CUDA path calls) with the
    documents' cu_seqlens, max_seqlen = S and causal attention; cu_seqlens' length is marked dynamic."""
    mask = attn.document_mask(DOCS, "varlen", torch.float32)
    assert isinstance(mask, attn.DocumentMask) and mask.kernel == "varlen"
    assert torch.equal(mask.cu_seqlens, attn.cu_seqlens(DOCS)) and mask.max_seqlen == S
    assert 0 in getattr(mask.cu_seqlens, "_dynamo_dynamic_indices", set())
    calls = []
    real = torch.ops.torch_attn._varlen_attn

    def spy(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(torch.ops.torch_attn, "_varlen_attn", spy)
    q, k, v = qkv(4, 2)
    attn.attention(q, k, v, mask)
    ((query, key, _, cu_q, cu_k, max_q, max_k, is_causal, _, window, gqa, *_),) = calls
    assert query.shape == (DOCS.numel(), 4, 8) and key.shape == (DOCS.numel(), 2, 8)
    assert cu_q is mask.cu_seqlens and cu_k is mask.cu_seqlens and max_q == max_k == S
    assert is_causal and list(window) == [-1, 0] and gqa


def test_kernel_choice_with_torch_varlen(monkeypatch):
    cpu, cuda, bf16, f32 = torch.device("cpu"), torch.device("cuda"), torch.bfloat16, torch.float32
    monkeypatch.setattr(attn, "_flash_attn_varlen_func", object())  # flash-attn installed
    assert attn.document_kernel("auto", cuda, bf16) == "varlen"  # torch's op first: it compiles
    assert attn.document_kernel("flash", cuda, bf16) == "flash_varlen"  # flash-attn stays selectable
    assert attn.document_kernel("auto", cuda, f32) == "flex"
    assert attn.document_kernel("varlen", cpu, f32) == "varlen"  # registered by the fixture
    with pytest.raises(RuntimeError, match="training.dtype"):
        attn.document_kernel("varlen", cuda, f32)
    # CPU auto above the dense threshold: per-document SDPA in eager layers, varlen in fullgraph-compiled ones
    big = attn.DENSE_MASK_MAX_ELEMENTS + 1
    assert attn.document_kernel("auto", cpu, f32, big) == "sdpa_per_doc"
    assert attn.document_kernel("auto", cpu, f32, big, graph_safe=True) == "varlen"
    assert attn.document_kernel("auto", cpu, f32, 1, graph_safe=True) == "dense"
    assert attn.fullgraph_ok("auto") and attn.fullgraph_ok("varlen") and not attn.fullgraph_ok("flash")
    monkeypatch.setattr(attn, "_TORCH_VARLEN", None)  # an older torch without varlen_attn
    assert attn.document_kernel("auto", cuda, bf16) == "flash_varlen"
    assert not attn.fullgraph_ok("auto")  # flash-attn's call is outside the graph
    monkeypatch.setattr(attn, "_flash_attn_varlen_func", None)
    assert attn.document_kernel("auto", cuda, bf16) == "flex"
    assert attn.fullgraph_ok("auto")  # FlexAttention traces
    with pytest.raises(RuntimeError, match="attention_backend='varlen'"):
        attn.document_kernel("varlen", cuda, bf16)


def test_varlen_without_enable_gqa_repeats_kv_heads(monkeypatch):
    """An older varlen_attn signature (is_causal=, no enable_gqa): kv heads are repeated, results unchanged."""
    fn, _, _ = attn._TORCH_VARLEN

    def old_signature(q, k, v, cu_q, cu_k, max_q, max_k, *, is_causal=False):
        assert q.shape[1] == k.shape[1], "GQA reached a varlen_attn without enable_gqa"
        return fn(q, k, v, cu_q, cu_k, max_q, max_k, window_size=(-1, 0) if is_causal else (-1, -1))

    monkeypatch.setattr(attn, "_TORCH_VARLEN", (old_signature, {"is_causal": True}, False))
    q, k, v = qkv(4, 2)
    ref = attn.attention(q, k, v, attn.causal_mask(S, S, "cpu", DOCS))
    out = attn.attention(q, k, v, attn.document_mask(DOCS, "varlen", torch.float32))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def _models(backend):
    cfg = LoopLMConfig(
        vocab_size=V,
        hidden_size=32,
        n_heads=4,
        n_kv_heads=2,
        ffn_hidden_size=64,
        n_layers=2,
        n_loops=3,
        max_seq_len=64,
        attention_backend=backend,
    )
    torch.manual_seed(0)
    model, ref = LoopLM(cfg), LoopLM(cfg.replace(attention_backend="sdpa"))
    ref.load_state_dict(model.state_dict())
    return model, ref


def test_model_on_varlen_matches_the_dense_mask_model():
    model, ref = _models("varlen")
    x = torch.randint(0, V, DOCS.shape, generator=torch.Generator().manual_seed(1))
    for m in (model, ref):
        sum(r.pow(2).mean() for r in m(x, doc_ids=DOCS).readouts).backward()
    for (name, p), (_, pr) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, pr.grad, rtol=1e-4, atol=1e-6, msg=name)
    with attn.math_attention():  # JSRR's forward-mode AD: the custom op has none, per-document SDPA instead
        h = torch.randn(*DOCS.shape, 32)
        cos, sin, mask = model.rope_and_mask(x, doc_ids=DOCS)
        _, jvp = torch.func.jvp(lambda z: model.loop_step(z, 0, cos, sin, mask), (h,), (torch.ones_like(h),))
    assert torch.isfinite(jvp).all()


@pytest.mark.parametrize("backend", ["varlen", "auto"])
def test_compiled_looped_layer_fullgraph_no_recompiles_across_loops_and_document_counts(backend):
    """apply_compile with document masking: fullgraph=True, and Dynamo records no graph break and compiles
    no new graph over T = 2, 3, 5 x batches of 12, 4 and 24 documents (varlen: cu_seqlens of three
    lengths; auto on CPU: the dense mask of this small batch). Outputs equal the eager dense-mask model."""
    torch._dynamo.reset()
    model, ref = _models(backend)
    assert apply_compile(model, backend="aot_eager") is True and model.graph_safe_attention
    x = torch.randint(0, V, DOCS.shape, generator=torch.Generator().manual_seed(1))
    res = fullgraph_check(model, x, [DOCS, *OTHER_DOCS], [2, 3, 5])
    assert res["doc_counts"] == [12, 4, 24]
    assert res["graph_breaks"] == 0, res
    assert res["graphs_after_all"] == res["graphs_after_first_step"], res
    assert res["ok"]
    for doc in OTHER_DOCS:
        torch.testing.assert_close(
            model(x, 4, doc_ids=doc).readouts[-1], ref(x, 4, doc_ids=doc).readouts[-1], rtol=1e-5, atol=1e-5
        )


def test_fullgraph_check_sees_recompiles_and_graph_breaks(monkeypatch):
    """The check can fail: without marking cu_seqlens dynamic every document count compiles a new graph,
    and per-document SDPA (compiled without fullgraph) breaks the graph."""
    x = torch.randint(0, V, DOCS.shape, generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    model, _ = _models("varlen")
    apply_compile(model, backend="aot_eager")
    monkeypatch.setattr(torch._dynamo, "mark_dynamic", lambda *a, **k: None)
    res = fullgraph_check(model, x, [DOCS, *OTHER_DOCS], [2])
    assert res["graphs_after_all"] > res["graphs_after_first_step"] and not res["ok"], res
    monkeypatch.undo()

    torch._dynamo.reset()
    model, _ = _models("sdpa_per_doc")
    assert apply_compile(model, backend="aot_eager") is False
    res = fullgraph_check(model, x, [DOCS], [2])
    assert res["graph_breaks"] > 0 and not res["ok"], res


def test_cuda_varlen_forward_traces_on_fake_tensors_without_a_gpu():
    """What a dry run can trace of the CUDA path (docs/parallelism.md): under FakeTensorMode with a ShapeEnv
    (cu_seqlens' length comes from nonzero: an unbacked size), fake CUDA tensors pick varlen and run its
    fake implementation, forward only. torch does not allow the backward: the autograd engine asks for the
    CUDA device's primary context (RuntimeError 'hasPrimaryContext') on a machine without one."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    if not torch.backends.cuda.is_built():
        pytest.skip("this torch is built without CUDA: no fake CUDA tensors")
    with FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv()):
        doc = torch.zeros(2, 64, dtype=torch.long, device="cuda")
        mask = attn.document_mask(doc, "auto", torch.bfloat16)
        q, k, v = (torch.empty(2, n, 64, 16, device="cuda", dtype=torch.bfloat16) for n in (4, 2, 2))
        out = attn.attention(q, k, v, mask)
    assert mask.kernel == "varlen" and not isinstance(mask.cu_seqlens.shape[0], int)
    assert out.shape == (2, 4, 64, 16) and out.device.type == "cuda"
