"""Rotary embeddings and the attention kernel choice.

Backend choice happens at call time: flash-attn when it is importable, the tensors are on CUDA and in
fp16/bf16, and no explicit mask is needed; PyTorch SDPA otherwise (causal). `pip install .[gpu]` adds
flash-attn; without it everything falls back to SDPA with no change in results beyond kernel rounding.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

try:  # optional GPU extra
    from flash_attn import flash_attn_func as _flash_attn_func  # type: ignore
except Exception:  # pragma: no cover - flash-attn is not installable without CUDA
    _flash_attn_func = None


_FORCE_MATH = False


def flash_available() -> bool:
    return _flash_attn_func is not None


@contextlib.contextmanager
def math_attention():
    """Run attention with PyTorch's math kernel (no flash-attn, no fused SDPA): the only kernels with
    forward-mode AD, which the JSRR Jacobian-vector product needs."""
    global _FORCE_MATH
    prev, _FORCE_MATH = _FORCE_MATH, True
    try:
        with sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        _FORCE_MATH = prev


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin tables for integer `positions` of shape [S] or [B, S]; returns tensors [..., S, head_dim]."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.to(torch.float32)[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)  # Hugging Face "rotate_half" layout, so Ouro weights load as-is
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, S, D]; cos/sin: [S, D] or [B, S, D]."""
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    return x * cos + _rotate_half(x) * sin


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              backend: str = "auto") -> torch.Tensor:
    """Causal attention. q: [B, H, Sq, D]; k, v: [B, Hkv, Sk, D]; mask: bool [B|1, 1, Sq, Sk] (True = attend)
    or None for plain causal attention with Sq == Sk. Returns [B, H, Sq, D]."""
    use_flash = (
        backend in ("auto", "flash")
        and _flash_attn_func is not None
        and q.is_cuda
        and q.dtype in (torch.float16, torch.bfloat16)
        and mask is None
        and not _FORCE_MATH
    )
    if backend == "flash" and not use_flash and q.is_cuda and _flash_attn_func is None:
        raise RuntimeError("attention_backend='flash' needs flash-attn: pip install 'titanloop[gpu]' or use 'auto'")
    if use_flash:
        out = _flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
        return out.transpose(1, 2)
    gqa = q.shape[1] != k.shape[1]
    if mask is None:
        if q.shape[2] == k.shape[2]:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        if q.shape[2] == 1:  # one decode step against a cache: attend to everything
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
        mask = causal_mask(q.shape[2], k.shape[2], q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def causal_mask(q_len: int, k_len: int, device, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Bottom-right aligned causal mask [B|1, 1, q_len, k_len]; with doc_ids [B, S] (q_len == k_len == S)
    attention is also restricted to tokens of the same document."""
    qi = torch.arange(k_len - q_len, k_len, device=device)[:, None]
    ki = torch.arange(k_len, device=device)[None, :]
    mask = (ki <= qi)[None, None]
    if doc_ids is not None:
        same = doc_ids[:, :, None] == doc_ids[:, None, :]
        mask = mask & same[:, None]
    return mask
