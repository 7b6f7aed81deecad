"""The fused per-loop readout (objective.ce_backward = "fused") against today's objective: the recompute path
(per_loop_cross_entropy) composed with the losses.py functions, values and gradients, for every objective."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from titanloop.config_errors import ConfigError
from titanloop.model import LoopLM, LoopLMConfig
from titanloop.objectives import (
    IGNORE_INDEX,
    ObjectiveConfig,
    dense_supervision_loss,
    final_loop_loss,
    fused_per_loop_cross_entropy,
    loop_objective,
    per_loop_cross_entropy,
    scale_penalty,
    stage1_loss,
    stage2_gate_loss,
)

V = 96
aten = torch.ops.aten


class MatmulFlops(TorchDispatchMode):
    """2 m k n per matrix product, in-place ones included (torch's FlopCounterMode skips addmm_)."""

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = func.overloadpacket
        if packet in (aten.mm, aten.addmm, aten.addmm_):
            a, b = args[-2:] if packet is aten.mm else args[1:3]
            self.flops += 2 * a.shape[0] * a.shape[1] * b.shape[1]
        else:
            assert packet not in (aten.bmm, aten.baddbmm, aten.matmul, aten.addmv, aten.mv), packet
        return func(*args, **(kwargs or {}))


def tiny_model(n_loops: int) -> LoopLM:
    torch.manual_seed(11)
    model = LoopLM(
        LoopLMConfig(
            vocab_size=V, hidden_size=32, n_heads=4, ffn_hidden_size=64, n_layers=2, n_loops=n_loops, max_seq_len=64
        )
    )
    with torch.no_grad():
        model.early_exit_gate.weight.normal_(std=0.5)  # a non-trivial exit distribution
    return model


def reference_objective(cfg: ObjectiveConfig, out, labels, head):
    """The objective as composed before the fused readout: per_loop_cross_entropy (backward recomputes the
    logits) fed to the losses.py functions."""
    mask = labels != IGNORE_INDEX
    if cfg.name == "final_only":
        loss = final_loop_loss(per_loop_cross_entropy(out.readouts[-1:], head, labels, cfg.ce_chunk_size)[0], mask)
        with torch.no_grad():
            ce = per_loop_cross_entropy(out.readouts, head, labels, cfg.ce_chunk_size)
    else:
        ce = per_loop_cross_entropy(out.readouts, head, labels, cfg.ce_chunk_size)
        if cfg.name == "stage1":
            loss = stage1_loss(ce, out.gate_logits, mask, cfg.beta, cfg.prior, cfg.geometric_eta)[0]
        elif cfg.name == "stage2_gate":
            loss = stage2_gate_loss(ce, out.gate_logits, mask, cfg.gate_k, cfg.gate_gamma)
        else:
            loss = dense_supervision_loss(ce, mask, cfg.dense_alpha, cfg.dense_schedule)
    if cfg.scale_penalty > 0:
        loss = loss + scale_penalty(out.states, mask, cfg.scale_penalty)
    return loss, ce.detach()


def _loss_and_grads(model, ids, labels, fn, upstream: float):
    model.zero_grad(set_to_none=True)
    out = model(ids)
    loss, ce = fn(out)
    (loss * upstream).backward()  # an upstream scale, as gradient accumulation (1/accum) and JSRR's (1 - λ) give
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), ce, grads


OBJECTIVES = [
    dict(name="stage1", beta=0.1),
    dict(name="stage1", beta=0.05, prior="geometric", geometric_eta=0.3, scale_penalty=0.01),
    dict(name="stage2_gate", scale_penalty=0.01),
    dict(name="dense", dense_alpha=0.5, dense_schedule="linear"),
    dict(name="dense", dense_alpha=1.0, dense_schedule="exponential", scale_penalty=0.01),
    dict(name="final_only"),
    dict(name="final_only", scale_penalty=0.01),
]


# every objective at every (T, chunk), except Stage II at T = 1: its gate loss compares consecutive loops (refused)
CASES = [
    (kw, n, c)
    for n, c in [(1, 4096), (3, 5), (4, 1), (4, 13)]
    for kw in OBJECTIVES
    if not (kw["name"] == "stage2_gate" and n < 2)
]


@pytest.mark.parametrize(
    "kw,n_loops,chunk", CASES, ids=lambda v: "-".join(f"{x}" for x in v.values()) if isinstance(v, dict) else str(v)
)
def test_loop_objective_equals_todays_objective_both_paths(kw, n_loops, chunk):
    model = tiny_model(n_loops)
    gen = torch.Generator().manual_seed(n_loops * 100 + chunk)
    ids = torch.randint(0, V, (2, 11), generator=gen)
    labels = torch.randint(0, V, (2, 11), generator=gen)
    labels[0, :3] = IGNORE_INDEX
    labels[1, 7] = IGNORE_INDEX
    head = model.lm_head.weight
    ref_cfg = ObjectiveConfig(ce_chunk_size=chunk, **kw)
    ref = _loss_and_grads(model, ids, labels, lambda out: reference_objective(ref_cfg, out, labels, head), 0.37)
    for path in ("fused", "recompute"):
        cfg = ObjectiveConfig(ce_chunk_size=chunk, ce_backward=path, **kw)

        def fn(out, cfg=cfg):
            loss, stats = loop_objective(cfg, out.readouts, out.states, out.gate_logits, labels, head)
            return loss, stats["ce"]

        loss, ce_stat, grads = _loss_and_grads(model, ids, labels, fn, 0.37)
        torch.testing.assert_close(loss, ref[0], rtol=1e-6, atol=1e-6)
        mask = labels != IGNORE_INDEX
        ref_ce_stat = (ref[1] * mask).sum((-2, -1)) / mask.sum()
        torch.testing.assert_close(ce_stat, ref_ce_stat, rtol=1e-6, atol=1e-6)
        assert grads.keys() == ref[2].keys(), (path, set(grads) ^ set(ref[2]))
        for name, g in grads.items():  # fp32 rounding through the model: relative to each gradient's scale
            r = ref[2][name]
            torch.testing.assert_close(
                g, r, rtol=1e-4, atol=1e-5 * float(r.abs().max()), msg=lambda m, n=name: f"{path} {n}: {m}"
            )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_loops,chunk", [(1, 3), (3, 1), (3, 7), (2, 1000)])
def test_fused_equals_weighted_recompute_values_and_grads(dtype, n_loops, chunk):
    """Arbitrary per-token, per-loop weights with their own gradient, ignored labels, an upstream scale."""
    gen = torch.Generator().manual_seed(n_loops * 10 + chunk)
    b, s, h, v = 2, 9, 16, 53
    readouts = [torch.randn(b, s, h, generator=gen).to(dtype).requires_grad_(True) for _ in range(n_loops)]
    head = (torch.randn(v, h, generator=gen) * 0.3).to(dtype).requires_grad_(True)
    labels = torch.randint(0, v, (b, s), generator=gen)
    labels[:, ::4] = IGNORE_INDEX
    weights = torch.rand(n_loops, b, s, generator=gen).requires_grad_(True)
    leaves = readouts + [head, weights]

    total, ce = fused_per_loop_cross_entropy(readouts, head, labels, weights, chunk)
    (total / 3).backward()
    fused = [x.grad.clone() for x in leaves]
    for x in leaves:
        x.grad = None
    ce_ref = per_loop_cross_entropy(readouts, head, labels, chunk)
    total_ref = (weights * ce_ref).sum()
    (total_ref / 3).backward()

    assert not ce.requires_grad and ce.dtype == torch.float32
    torch.testing.assert_close(ce, ce_ref.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(total, total_ref.detach(), rtol=1e-6, atol=1e-6)
    assert (ce[:, :, ::4] == 0).all() and all((x.grad[:, ::4] == 0).all() for x in readouts)
    # bf16: the fused path rounds d/d readout to bf16 before the upstream scale, the recompute path after it; the
    # bf16 matmul inputs differ by rounding, so allow a few bf16 ulps of the gradient's scale (eps = 2^-8)
    for x, g in zip(leaves, fused):
        assert g.dtype == x.dtype
        scale = float(x.grad.abs().max())
        tol = dict(rtol=1e-5, atol=1e-6 * scale) if dtype == torch.float32 else dict(rtol=2**-6, atol=2**-7 * scale)
        torch.testing.assert_close(g, x.grad, **tol)


def test_fused_path_forms_each_loops_logits_once():
    """Head matmuls in forward + backward: 3 per loop fused (logits, d/d readout, d/d head) vs 4 recompute."""
    t, b, s, h, v = 3, 2, 8, 16, 64
    readouts = [torch.randn(b, s, h, requires_grad=True) for _ in range(t)]
    head = torch.randn(v, h, requires_grad=True)
    labels = torch.randint(0, v, (b, s))
    weights = torch.rand(t, b, s)
    one_matmul = 2 * t * b * s * h * v

    def flops(fn):
        with MatmulFlops() as counter:
            fn().backward()
        return counter.flops

    assert flops(lambda: fused_per_loop_cross_entropy(readouts, head, labels, weights, 5)[0]) == 3 * one_matmul
    assert flops(lambda: (weights * per_loop_cross_entropy(readouts, head, labels, 5)).sum()) == 4 * one_matmul


def test_fused_without_grad_only_computes_the_ce():
    readouts = [torch.randn(2, 5, 8, requires_grad=True) for _ in range(2)]
    head = torch.randn(40, 8, requires_grad=True)
    labels = torch.randint(0, 40, (2, 5))
    weights = torch.rand(2, 2, 5)
    with torch.no_grad():
        total, ce = fused_per_loop_cross_entropy(readouts, head, labels, weights)
    torch.testing.assert_close(ce, per_loop_cross_entropy(readouts, head, labels).detach())
    torch.testing.assert_close(total, (weights * ce).sum())
    with MatmulFlops() as counter:  # the head alone needs no grad: no d/d head matmul
        fused_per_loop_cross_entropy(readouts, head.detach(), labels, weights)[0].backward()
    assert counter.flops == 2 * (2 * 2 * 2 * 5 * 8 * 40) and head.grad is None


def test_bad_inputs_are_one_line_naming_the_field():
    with pytest.raises(ConfigError, match=r"^objective\.ce_backward='triton' is invalid: expected one of"):
        ObjectiveConfig(ce_backward="triton")
    readouts = [torch.randn(2, 5, 8)]
    with pytest.raises(ConfigError, match=r"^loop_weights=\(2, 2, 5\) is invalid: expected the shape"):
        fused_per_loop_cross_entropy(
            readouts, torch.randn(40, 8), torch.zeros(2, 5, dtype=torch.long), torch.rand(2, 2, 5)
        )


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_readout_check_runs_on_cpu(dtype, tol):
    """The call the GPU check makes on CUDA; here its logic at a tiny shape on CPU (timings are not judged)."""
    from titanloop.checks.numerics import fused_readout_comparison as check_fused_readout

    res = check_fused_readout("cpu", dtype, loops=3, batch=2, seq_len=16, hidden=32, vocab=80, chunk_size=7, repeats=1)
    assert set(res["max_rel_err"]) == {"loss", "readouts", "lm_head", "gate"}
    assert all(err <= tol for err in res["max_rel_err"].values()), res["max_rel_err"]
    assert set(res["seconds"]) == {"fused", "recompute"} and res["peak_bytes"] == {"fused": None, "recompute": None}


def _fake_cuda_readout(n_loops=2, tokens=24, hidden=16, vocab=V):
    """The fused readout's forward (where it forms the head's gradient) on fake CUDA bf16 tensors, no GPU needed:
    the matrix products it runs. (A backward would need a CUDA context, which fake tensors do not give.)"""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        readouts = [torch.randn(1, tokens, hidden, device="cuda", dtype=torch.bfloat16) for _ in range(n_loops)]
        for r in readouts:
            r.requires_grad_(True)
        weight = torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        targets = torch.randint(0, vocab, (1, tokens), device="cuda")
        w = torch.full((n_loops, 1, tokens), 1.0 / tokens, device="cuda")
        with MatmulOps() as ops:
            total, ce = fused_per_loop_cross_entropy(readouts, weight, targets, w, chunk_size=8)
        return ops.seen, total.dtype, ce.dtype


class MatmulOps(TorchDispatchMode):
    """(op name, input dtypes[, "in place"]) of every matrix product."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (aten.mm, aten.addmm, aten.addmm_):
            dtypes = tuple(str(a.dtype) for a in args if isinstance(a, torch.Tensor))
            in_place = (kwargs or {}).get("out") is args[0] or func.overloadpacket is aten.addmm_
            self.seen.append((str(func), dtypes + (("in place",) if in_place else ())))
        return func(*args, **(kwargs or {}))


def test_lm_head_grad_is_one_bf16_gemm_with_fp32_accumulation_on_cuda(monkeypatch):
    """On CUDA with a bf16 head, the head's gradient is accumulated by addmm's out_dtype overload from bf16
    operands into the fp32 buffer (the fp32 SIMT GEMM of issue 35's H100 profile is gone); where torch lacks
    that overload the fp32 product is used, with one warning, and the result is the same shape and dtype."""
    from titanloop.objectives import chunked_ce

    monkeypatch.setattr(chunked_ce, "_BF16_HEAD_GRAD", [True], raising=False)
    seen, total_dtype, ce_dtype = _fake_cuda_readout()
    head = [s for s in seen if s[0].startswith("aten.addmm")]
    # (self, mat1, mat2, out): fp32 accumulator, bf16 operands, written in place; one per chunk (24 x 2 / 8)
    expect = ("aten.addmm.dtype_out", ("torch.float32", "torch.bfloat16", "torch.bfloat16", "in place"))
    assert len(head) == 6 and all(s == expect for s in head), seen
    assert total_dtype == ce_dtype == torch.float32

    def missing(*a, **k):
        if "out_dtype" in k:
            raise TypeError("addmm() got an unexpected keyword argument 'out_dtype'")
        return real(*a, **k)

    real = torch.addmm
    monkeypatch.setattr(torch, "addmm", missing)
    with pytest.warns(UserWarning, match="bf16 LM-head gradient GEMM unavailable"):
        seen, _, _ = _fake_cuda_readout()
    head = [s for s in seen if s[0].startswith("aten.addmm")]
    assert chunked_ce._BF16_HEAD_GRAD == [False]
    fp32 = ("aten.addmm_.default", ("torch.float32",) * 3 + ("in place",))
    assert len(head) == 6 and all(s == fp32 for s in head), seen


def test_cpu_lm_head_grad_keeps_the_fp32_product():
    """Off CUDA nothing changes: the head gradient is the fp32 addmm_ (CPU results stay comparable)."""
    torch.manual_seed(0)
    readouts = [torch.randn(1, 24, 16, dtype=torch.bfloat16, requires_grad=True) for _ in range(2)]
    weight = torch.randn(V, 16, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, V, (1, 24))
    with MatmulOps() as ops:
        total, _ = fused_per_loop_cross_entropy(readouts, weight, targets, torch.full((2, 1, 24), 1 / 24), 8)
        total.backward()
    head = [s for s in ops.seen if s[0].startswith("aten.addmm")]
    assert head and all(s == ("aten.addmm_.default", ("torch.float32",) * 3 + ("in place",)) for s in head), ops.seen
