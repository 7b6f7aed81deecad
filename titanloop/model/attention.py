"""Rotary embeddings, document masks and the attention kernel choice.

Plain causal attention (no document mask): flash-attn when it is importable, the tensors are on CUDA and
in fp16/bf16; PyTorch SDPA (causal) otherwise.

Document masking (packed sequences, `doc_ids`) builds a dense [B, 1, S, S] mask only where that is the
fastest kernel (small batches on CPU) or asked for (`sdpa`). `document_mask` runs once per forward, outside
the compiled layers, and returns either that dense mask or a `DocumentMask`: the document boundaries as
cumulative sequence lengths over the flattened batch (`cu_seqlens`, int32) plus the kernel that will use
them. The kernel follows `attention_backend`:

    backend        document-masked attention with
    auto           CUDA + fp16/bf16 + flash-attn: flash_attn_varlen_func; other CUDA: FlexAttention
                   (compiled, document block mask); CPU: one SDPA call with the dense boolean mask
                   [B, 1, S, S] while it has <= DENSE_MASK_MAX_ELEMENTS elements, SDPA per document above
    flash          as auto (flash-attn is required on CUDA)
    flex           FlexAttention with a document block mask (CPU: forward only, torch has no CPU backward)
    sdpa_per_doc   one causal SDPA call per document (memory per call: the largest document squared)
    sdpa           the dense boolean mask [B, 1, S, S] with SDPA (the reference; O(S^2) mask memory)

The varlen and per-document calls are kept out of torch.compile graphs (`torch.compiler.disable`): their
argument shapes change with the number of documents in a batch, which would otherwise recompile the
layer for every new count; the compiled layer becomes two graphs around the attention call.

RoPE positions: by default positions run 0..S-1 across the packed row. With a document mask this gives the
same attention as restarting positions per document (RoPE scores depend on i - j only, and no query sees
another document), so `rope_per_document` (LoopLMConfig, default off) changes results only by rounding of
the rotation angles; it is there for runs that want position ids to match an unpacked evaluation exactly.

`pip install .[gpu]` adds flash-attn; without it everything falls back with no change in results beyond
kernel rounding.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

try:  # optional GPU extra
    from flash_attn import flash_attn_func as _flash_attn_func  # type: ignore
    from flash_attn import flash_attn_varlen_func as _flash_attn_varlen_func  # type: ignore
except Exception:  # pragma: no cover - flash-attn is not installable without CUDA
    _flash_attn_func = _flash_attn_varlen_func = None


_FORCE_MATH = False
# CPU `auto`: the largest dense document mask [B, 1, S, S] (B*S*S elements; 2**19 = 512 KiB of bool) used
# instead of one SDPA call per document. Measured (attention forward + backward, one thread, mean document
# length S/8 or shorter): dense was 1.4-7x faster than per-document calls at and below 2**19 elements (the
# per-call overhead dominates short documents: 20 vs 1.4 ms at 32 x 32 tokens, 141 documents), but 0.6-3.3x
# slower from 2**20 on (dense pays for all S*S scores, per-document calls for sum(len^2)). The demo's batch
# (32 x 32 tokens) is 2**15. benchmarks/document_masking.py measures the demo's training step.
DENSE_MASK_MAX_ELEMENTS = 2**19
DOC_KERNELS = ("flash_varlen", "flex", "sdpa_per_doc", "dense")
_HALF = (torch.float16, torch.bfloat16)


def flash_available() -> bool:
    return _flash_attn_func is not None


@contextlib.contextmanager
def math_attention():
    """Run attention with PyTorch's math kernel (no flash-attn, no fused SDPA): the only kernels with
    forward-mode AD, which the JSRR Jacobian-vector product needs. A DocumentMask runs SDPA per document, a
    dense mask one SDPA call."""
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


# ----- document masks -------------------------------------------------------------------------------
def _doc_starts(doc_ids: torch.Tensor) -> torch.Tensor:
    """bool [B, S]: True where a document starts (first token of a row, or a change of doc id). Documents
    are runs of equal consecutive ids, which is what packing produces (non-decreasing ids per row)."""
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return starts


def document_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """RoPE positions [B, S] restarting at 0 at every document start."""
    idx = torch.arange(doc_ids.shape[1], device=doc_ids.device).expand_as(doc_ids)
    start = torch.where(_doc_starts(doc_ids), idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - start


def cu_seqlens(doc_ids: torch.Tensor) -> torch.Tensor:
    """Cumulative document lengths over the flattened [B*S] tokens, int32 [n_docs + 1] (flash-attn's
    varlen format); rows never share a document, so every row start is a boundary."""
    starts = _doc_starts(doc_ids).flatten().nonzero().flatten()
    end = torch.tensor([doc_ids.numel()], device=doc_ids.device, dtype=starts.dtype)
    return torch.cat([starts, end]).to(torch.int32)


def document_lengths(doc_ids: torch.Tensor) -> list[int]:
    """Lengths of the packed documents of a [B, S] batch, row by row (what the MFU count attends over)."""
    return cu_seqlens(doc_ids).diff().tolist()


@dataclass
class DocumentMask:
    """Causal attention restricted to packed documents, without a dense [S, S] mask.

    cu_seqlens: int32 [n_docs + 1] offsets into the flattened B*S tokens; max_seqlen: S, an upper bound on
    the document length (flash-attn sizes its grid with it; S needs no device-to-host copy and stays
    constant across batches); kernel: one of DOC_KERNELS except 'dense'; block_mask: FlexAttention's
    BlockMask when kernel == 'flex'."""

    cu_seqlens: torch.Tensor
    max_seqlen: int
    kernel: str
    block_mask: Any = None

    @property
    def doc_lengths(self) -> list[int]:
        return self.cu_seqlens.diff().tolist()


def document_kernel(backend: str, device: torch.device, dtype: torch.dtype,
                    mask_elements: int | None = None) -> str:
    """Which kernel computes document-masked attention for `backend` (see the module docstring).
    mask_elements: B*S*S, the size the dense mask would have (CPU `auto` uses it when it is small; None
    counts as large)."""
    cuda = torch.device(device).type == "cuda"
    if backend in ("sdpa_per_doc", "flex"):
        return backend
    if backend == "sdpa":
        return "dense"
    if backend == "flash" and cuda and _flash_attn_varlen_func is None:
        raise RuntimeError("attention_backend='flash' needs flash-attn: pip install 'titanloop[gpu]' or use 'auto'")
    if cuda and dtype in _HALF and _flash_attn_varlen_func is not None:
        return "flash_varlen"
    if cuda:
        return "flex"
    small = mask_elements is not None and mask_elements <= DENSE_MASK_MAX_ELEMENTS
    return "dense" if backend == "auto" and small else "sdpa_per_doc"


def document_mask(doc_ids: torch.Tensor, backend: str, dtype: torch.dtype,
                  kernel: str | None = None) -> "DocumentMask | torch.Tensor":
    """The document mask for one forward over doc_ids [B, S]: a DocumentMask, or the dense boolean mask
    [B, 1, S, S] when the kernel is 'dense'. `kernel` overrides the choice document_kernel makes."""
    b, s = doc_ids.shape
    kernel = kernel or document_kernel(backend, doc_ids.device, dtype, b * s * s)
    if kernel == "dense":
        return causal_mask(s, s, doc_ids.device, doc_ids)
    block_mask = None
    if kernel == "flex":
        from torch.nn.attention.flex_attention import create_block_mask

        def same_doc_causal(bi, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (doc_ids[bi, q_idx] == doc_ids[bi, kv_idx])

        block_mask = create_block_mask(same_doc_causal, b, None, s, s, device=doc_ids.device)
    return DocumentMask(cu_seqlens(doc_ids), s, kernel, block_mask)


_compiled_flex = None


def _flex(q, k, v, block_mask, gqa):
    """FlexAttention; compiled on CUDA (eager flex materializes the scores), eager on CPU (forward only)."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    fn = flex_attention
    if q.is_cuda:
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention, dynamic=False)
        fn = _compiled_flex
    return fn(q, k, v, block_mask=block_mask, enable_gqa=gqa)


@torch.compiler.disable
def _flash_varlen(q, k, v, mask: DocumentMask):
    b, _, s, d = q.shape
    flat = [x.transpose(1, 2).reshape(b * s, x.shape[1], d) for x in (q, k, v)]  # [B*S, heads, D]
    out = _flash_attn_varlen_func(*flat, cu_seqlens_q=mask.cu_seqlens, cu_seqlens_k=mask.cu_seqlens,
                                  max_seqlen_q=mask.max_seqlen, max_seqlen_k=mask.max_seqlen, causal=True)
    return out.view(b, s, -1, d).transpose(1, 2)


@torch.compiler.disable
def _sdpa_per_doc(q, k, v, mask: DocumentMask, gqa: bool):
    b, _, s, d = q.shape
    flat = [x.transpose(0, 1).reshape(x.shape[1], b * s, d) for x in (q, k, v)]  # [heads, B*S, D]
    bounds = mask.cu_seqlens.tolist()
    outs = [F.scaled_dot_product_attention(*(x[:, lo:hi] for x in flat), is_causal=True, enable_gqa=gqa)
            for lo, hi in zip(bounds[:-1], bounds[1:])]
    return torch.cat(outs, dim=1).view(-1, b, s, d).transpose(0, 1)


def _document_attention(q, k, v, mask: DocumentMask) -> torch.Tensor:
    gqa = q.shape[1] != k.shape[1]
    kernel = "sdpa_per_doc" if _FORCE_MATH else mask.kernel
    if kernel == "flash_varlen":
        return _flash_varlen(q, k, v, mask)
    if kernel == "flex":
        return _flex(q, k, v, mask.block_mask, gqa)
    return _sdpa_per_doc(q, k, v, mask, gqa)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: "torch.Tensor | DocumentMask | None",
              backend: str = "auto") -> torch.Tensor:
    """Causal attention. q: [B, H, Sq, D]; k, v: [B, Hkv, Sk, D]; mask: a DocumentMask (Sq == Sk), a bool
    [B|1, 1, Sq, Sk] (True = attend) or None for plain causal attention with Sq == Sk. Returns [B, H, Sq, D]."""
    if isinstance(mask, DocumentMask):
        return _document_attention(q, k, v, mask)
    use_flash = (
        backend in ("auto", "flash")
        and _flash_attn_func is not None
        and q.is_cuda
        and q.dtype in _HALF
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
