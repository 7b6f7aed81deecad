"""A CPU kernel for torch's variable-length attention op, so the CUDA document-masking path runs on CPU.

`torch.nn.attention.varlen.varlen_attn` (torch 2.14) is a registered custom op, `torch_attn::_varlen_attn`,
with a fake (meta) implementation, an autograd formula that calls `torch_attn::_varlen_attn_backward`, and
FLOP counting; torch ships only CUDA kernels for the two ops. `register()` adds CPU kernels for both:
per document, PyTorch's CPU flash-attention kernel (`aten._scaled_dot_product_flash_attention_for_cpu`)
forward and its analytic backward (`..._for_cpu_backward`), with the documents read from cu_seqlens. With
them, the exact op the CUDA path calls, with its autograd and its fake implementation, runs and compiles
(torch.compile fullgraph=True) on CPU: tests/test_model_attention_varlen.py uses this to check the CUDA code path
against the dense-mask SDPA reference, for graph breaks and for recompiles.

It computes what per-document SDPA computes (same kernel, same work), so it is not faster than
`sdpa_per_doc` in eager mode; the CPU default stays `attention.document_kernel`'s choice. Registration is
global for the process (torch.library), idempotent, and needed only on CPU:

    from titanloop.model import varlen_cpu
    varlen_cpu.register()          # True, or False when this torch has no varlen op of the expected schema
"""

from __future__ import annotations

import torch

_REGISTERED = False
_FWD_ARGS = (
    "query",
    "key",
    "value",
    "cu_seq_q",
    "cu_seq_k",
    "max_q",
    "max_k",
    "is_causal",
    "scale",
    "window_size",
    "enable_gqa",
)
_BWD_ARGS = (
    "grad_out",
    "query",
    "key",
    "value",
    "out",
    "lse",
    "cu_seq_q",
    "cu_seq_k",
    "max_q",
    "max_k",
    "is_causal",
    "rng_state",
    "scale",
    "window_size",
)


def _op(name: str):
    try:
        import torch.nn.attention.varlen  # noqa: F401  (defines the torch_attn ops)

        return getattr(torch.ops.torch_attn, name).default
    except (ImportError, AttributeError, RuntimeError):
        return None


def _schema_ok(op, names: tuple[str, ...]) -> bool:
    have = [a.name for a in op._schema.arguments]
    return have[: len(names)] == list(names)


def unavailable_reason() -> str | None:
    """Why register() cannot work with this torch (None when it can)."""
    fwd, bwd = _op("_varlen_attn"), _op("_varlen_attn_backward")
    if fwd is None or bwd is None:
        return f"torch {torch.__version__} has no torch_attn::_varlen_attn op (torch.nn.attention.varlen)"
    if not (_schema_ok(fwd, _FWD_ARGS) and _schema_ok(bwd, _BWD_ARGS)):
        return (
            f"torch {torch.__version__}'s torch_attn::_varlen_attn has another schema than the one this "
            "kernel implements (torch 2.14)"
        )
    return None


def registered() -> bool:
    return _REGISTERED


def _causal(is_causal: bool, window_size) -> bool:
    window = list(window_size) if window_size is not None else [-1, -1]
    if window not in ([-1, -1], [-1, 0]):
        raise NotImplementedError(f"varlen_cpu: window_size {window} (sliding windows) has no CPU kernel here")
    return bool(is_causal) or window == [-1, 0]


def _docs(cu_seq: torch.Tensor) -> list[tuple[int, int]]:
    bounds = cu_seq.tolist()
    return [(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:]) if hi > lo]


def _heads_first(x: torch.Tensor, lo: int, hi: int, rep: int = 1) -> torch.Tensor:
    """[total, heads, D] rows lo:hi -> [1, heads * rep, L, D] (GQA: each kv head repeated for its group)."""
    x = x[lo:hi].transpose(0, 1)
    if rep > 1:
        x = x.repeat_interleave(rep, dim=0)
    return x.unsqueeze(0)


def _forward(
    query,
    key,
    value,
    cu_seq_q,
    cu_seq_k,
    max_q,
    max_k,
    is_causal=False,
    scale=None,
    window_size=None,
    enable_gqa=False,
    seqused_k=None,
    block_table=None,
    num_splits=None,
):
    if seqused_k is not None or block_table is not None:
        raise NotImplementedError("varlen_cpu: seqused_k / block_table (paged KV cache) have no CPU kernel here")
    causal = _causal(is_causal, window_size)
    cu_k = cu_seq_q if cu_seq_k is None else cu_seq_k
    rep = query.shape[1] // key.shape[1]
    out = torch.zeros_like(query)
    lse = torch.zeros(query.shape[1], query.shape[0], dtype=torch.float32, device=query.device)
    for (lo, hi), (klo, khi) in zip(_docs(cu_seq_q), _docs(cu_k)):
        o, l_ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            _heads_first(query, lo, hi),
            _heads_first(key, klo, khi, rep),
            _heads_first(value, klo, khi, rep),
            0.0,
            causal,
            scale=scale,
        )
        out[lo:hi] = o[0].transpose(0, 1)
        lse[:, lo:hi] = l_[0].float()
    return out, lse, torch.zeros(2, dtype=torch.uint64, device=query.device)


def _backward(
    grad_out,
    query,
    key,
    value,
    out,
    lse,
    cu_seq_q,
    cu_seq_k,
    max_q,
    max_k,
    is_causal,
    rng_state,
    scale=None,
    window_size=None,
):
    causal = _causal(is_causal, window_size)
    rep = query.shape[1] // key.shape[1]
    dq, dk, dv = torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)
    for (lo, hi), (klo, khi) in zip(_docs(cu_seq_q), _docs(cu_seq_k)):
        g, q_, o = (_heads_first(x, lo, hi) for x in (grad_out, query, out))
        k_, v_ = _heads_first(key, klo, khi, rep), _heads_first(value, klo, khi, rep)
        l_ = lse[:, lo:hi].unsqueeze(0).to(torch.float32)
        gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            g.contiguous(),
            q_.contiguous(),
            k_.contiguous(),
            v_.contiguous(),
            o.contiguous(),
            l_.contiguous(),
            0.0,
            causal,
            scale=scale,
        )
        dq[lo:hi] = gq[0].transpose(0, 1)
        # GQA: a kv head's gradient sums over the query heads of its group
        dk[klo:khi] = gk[0].unflatten(0, (key.shape[1], rep)).sum(1).transpose(0, 1)
        dv[klo:khi] = gv[0].unflatten(0, (value.shape[1], rep)).sum(1).transpose(0, 1)
    return dq, dk, dv


def register() -> bool:
    """Register the CPU kernels of torch_attn::_varlen_attn and torch_attn::_varlen_attn_backward (once per
    process). Returns False, registering nothing, when this torch lacks the ops or their 2.14 schema."""
    global _REGISTERED
    if _REGISTERED:
        return True
    if unavailable_reason() is not None:
        return False
    torch.library.register_kernel("torch_attn::_varlen_attn", "cpu", _forward)
    torch.library.register_kernel("torch_attn::_varlen_attn_backward", "cpu", _backward)
    _REGISTERED = True
    return True
