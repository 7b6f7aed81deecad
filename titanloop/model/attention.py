"""Rotary embeddings, document masks and the attention kernel choice.

Plain causal attention (no document mask): flash-attn when it is importable, the tensors are on CUDA and
in fp16/bf16; PyTorch SDPA (causal) otherwise.

Document masking (packed sequences, `doc_ids`) builds a dense [B, 1, S, S] mask only where that is the
fastest kernel (small batches on CPU) or asked for (`sdpa`). `document_mask` runs once per forward, outside
the compiled layers, and returns either that dense mask or a `DocumentMask`: the document boundaries as
cumulative sequence lengths over the flattened batch (`cu_seqlens`, int32) plus the kernel that will use
them. The kernel follows `attention_backend`:

    backend        document-masked attention with
    auto           CUDA + fp16/bf16: torch's varlen_attn (torch.nn.attention.varlen, a custom op with fake,
                   autograd and FLOP-count registrations: compiles into the layer's graph); where torch lacks
                   it (or has a signature `_torch_varlen` does not know) flash-attn's
                   flash_attn_varlen_func when installed, else FlexAttention. CUDA fp32: FlexAttention.
                   CPU: one SDPA call with the dense boolean mask [B, 1, S, S] while it has
                   <= DENSE_MASK_MAX_ELEMENTS elements, SDPA per document above (or, in layers compiled
                   with fullgraph, varlen_attn on its CPU reference kernel, titanloop.model.varlen_cpu)
    varlen         torch's varlen_attn; on CPU it registers and runs the reference kernel of
                   titanloop.model.varlen_cpu (tests of the CUDA path; the same kernel as sdpa_per_doc, about as fast)
    flash          flash-attn 2 (optional, `pip install .[gpu]`): flash_attn_varlen_func on CUDA (required
                   there), as auto on CPU
    flex           FlexAttention with a document block mask (CPU: forward only, torch has no CPU backward)
    sdpa_per_doc   one causal SDPA call per document (memory per call: the largest document squared)
    sdpa           the dense boolean mask [B, 1, S, S] with SDPA (the reference; O(S^2) mask memory)

A batch whose rows never cross a document boundary needs no document mask at all: under `auto`, with eager
layers, a model checks its host doc ids (`rows_are_documents`; the LoopLM and the retrofit model both do) and
runs plain causal attention, bitwise the forward without doc ids (compiled layers keep one mask type and always
build the mask).

What runs inside torch.compile (titanloop.parallel.apply_compile, one graph per decoder layer): the dense
mask, varlen_attn and FlexAttention trace into the layer's graph (fullgraph=True, no graph break). The
number of documents changes the length of cu_seqlens; `document_mask` marks that dimension dynamic
(torch._dynamo.mark_dynamic), so a new count reuses the graph instead of recompiling. flash-attn's varlen
call and the per-document SDPA loop (which reads the boundaries on the host) stay outside the graph
(`torch.compiler.disable`): with `flash` or `sdpa_per_doc`, apply_compile compiles with fullgraph=False and
the layer is two graphs around the attention call. Under `math_attention` (JSRR's forward-mode AD) a
DocumentMask always runs per-document SDPA (math kernel): the custom op has no forward-mode AD.

Fake tensors (dry run, memory plan): on fake CUDA tensors, with a ShapeEnv for the data-dependent length of
cu_seqlens (nonzero), `auto` picks varlen and its forward runs on the op's fake implementation without a GPU;
the backward does not (torch's autograd engine asks for the CUDA device's context: 'hasPrimaryContext'), so
the memory plan keeps planning document masking as causal attention.

RoPE positions: by default positions run 0..S-1 across the packed row. With a document mask this gives the
same attention as restarting positions per document (RoPE scores depend on i - j only, and no query sees
another document), so `rope_per_document` (LoopLMConfig, default off) changes results only by rounding of
the rotation angles; it is there for runs that want position ids to match an unpacked evaluation exactly.

`pip install .[gpu]` adds flash-attn; without it everything falls back with no change in results beyond
kernel rounding. torch's varlen_attn needs no extra package (its CUDA kernels are torch's own flash / cuDNN
attention); on a torch without it (e.g. 2.11, where the module may be missing or take `is_causal=` and no
`enable_gqa`), `_torch_varlen` adapts to the signature it finds or reports None, and `auto` falls back to
flash-attn, then FlexAttention.
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


def _torch_varlen():
    """torch's varlen_attn and how to ask it for causal attention in this torch version: (fn, causal
    kwargs, whether it takes enable_gqa), or None when the module or a known signature is missing."""
    try:
        import inspect

        from torch.nn.attention.varlen import varlen_attn
    except Exception:  # torch < 2.9, or a build without it
        return None
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:  # torch 2.14: causal is window_size == (-1, 0)
        causal = {"window_size": (-1, 0)}
    elif "is_causal" in params:  # earlier releases
        causal = {"is_causal": True}
    else:
        return None
    return varlen_attn, causal, "enable_gqa" in params


_TORCH_VARLEN = _torch_varlen()


_FORCE_MATH = False
# CPU `auto`: the largest dense document mask [B, 1, S, S] (B*S*S elements; 2**19 = 512 KiB of bool) used
# instead of one SDPA call per document. Measured (attention forward + backward, one thread, heads x head dim
# 4 x 16 and 8 x 64, mean document length S/8 or shorter): at and below 2**19 elements dense was 1.3-15x
# faster than per-document calls in every case (the per-call overhead dominates short documents: 1.4 vs
# 20 ms at 32 x 32 tokens, 141 documents); from 2**20 on per-document calls were 1.35-12x faster (dense
# pays for all S*S scores, per-document calls for sum(len^2)) except with many short documents (4 x 512
# tokens, 136 documents: dense 1.6x faster). The demo's batch (32 x 32 tokens) is 2**15.
# The demo's training step under each kernel: benchmarks/results/2026-11-29-cpu-document-masking.json.
DENSE_MASK_MAX_ELEMENTS = 2**19
DOC_KERNELS = ("varlen", "flash_varlen", "flex", "sdpa_per_doc", "dense")
_HALF = (torch.float16, torch.bfloat16)


def flash_available() -> bool:
    return _flash_attn_func is not None


def torch_varlen_available(device) -> bool:
    """torch's varlen_attn can run on `device`: CUDA when this torch has it, CPU once the reference kernel
    is registered (titanloop.model.varlen_cpu.register())."""
    if _TORCH_VARLEN is None:
        return False
    if torch.device(device).type == "cuda":
        return True
    from titanloop.model import varlen_cpu  # (registers CPU kernels: only when a CPU varlen call needs them)

    return torch.device(device).type == "cpu" and varlen_cpu.registered()


def fullgraph_ok(backend: str) -> bool:
    """Whether layers of a model with attention_backend `backend` compile with fullgraph=True: every kernel
    the backend can pick traces (flash-attn and per-document SDPA are outside the graph). `auto` on a torch
    without varlen_attn but with flash-attn picks flash-attn on CUDA, so it compiles without fullgraph."""
    if backend == "auto" and _TORCH_VARLEN is None and _flash_attn_varlen_func is not None:
        return False
    return backend not in ("flash", "sdpa_per_doc")


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


def document_kernel(
    backend: str, device: torch.device, dtype: torch.dtype, mask_elements: int | None = None, graph_safe: bool = False
) -> str:
    """Which kernel computes document-masked attention for `backend` (see the module docstring).
    mask_elements: B*S*S, the size the dense mask would have (CPU `auto` uses it when it is small; None
    counts as large). graph_safe: the layers are compiled with fullgraph=True, so CPU `auto` above the
    threshold takes varlen_attn on its CPU reference kernel (registered here) instead of per-document SDPA."""
    cuda = torch.device(device).type == "cuda"
    if backend in ("sdpa_per_doc", "flex"):
        return backend
    if backend == "sdpa":
        return "dense"
    if backend == "varlen":
        if _TORCH_VARLEN is None:
            raise RuntimeError(
                f"model.attention_backend='varlen' needs torch.nn.attention.varlen.varlen_attn, "
                f"which torch {torch.__version__} lacks: use 'auto'"
            )
        if cuda and dtype not in _HALF:
            raise RuntimeError(
                f"model.attention_backend='varlen' runs fp16/bf16 on CUDA, got {dtype}: set "
                "training.dtype to bf16 (or 'auto'), or use attention_backend 'auto'"
            )
        if not cuda:
            from titanloop.model import varlen_cpu  # (registers CPU kernels: only when a CPU varlen call needs them)

            if not varlen_cpu.register():
                raise RuntimeError(
                    f"model.attention_backend='varlen' on CPU needs the reference kernel of "
                    f"titanloop.model.varlen_cpu: {varlen_cpu.unavailable_reason()}; use 'auto'"
                )
        return "varlen"
    if backend == "flash" and cuda and _flash_attn_varlen_func is None:
        raise RuntimeError("attention_backend='flash' needs flash-attn: pip install 'titanloop[gpu]' or use 'auto'")
    if cuda and dtype in _HALF:
        if backend == "flash":
            return "flash_varlen"
        if _TORCH_VARLEN is not None:
            return "varlen"
        if _flash_attn_varlen_func is not None:
            return "flash_varlen"
    if cuda:
        return "flex"
    if mask_elements is not None and mask_elements <= DENSE_MASK_MAX_ELEMENTS:
        return "dense"
    if graph_safe:
        from titanloop.model import varlen_cpu  # (registers CPU kernels: only when a CPU varlen call needs them)

        return "varlen" if varlen_cpu.register() else "dense"
    return "sdpa_per_doc"


def rows_are_documents(
    doc_ids: torch.Tensor, host_doc_ids: torch.Tensor | None, backend: str, compiled_layers: bool
) -> bool:
    """True when no row of the batch crosses a document boundary, so document masking is plain causal attention:
    read on host ids only (no device sync: host_doc_ids, else doc_ids when they are on the CPU), under backend
    'auto' and eager layers (a compiled layer keeps one mask type, so it never switches graphs)."""
    ids = host_doc_ids if host_doc_ids is not None else doc_ids
    if ids.device.type != "cpu" or backend != "auto" or compiled_layers:
        return False
    return bool((ids[:, 1:] == ids[:, :-1]).all())


def document_mask(
    doc_ids: torch.Tensor,
    backend: str,
    dtype: torch.dtype,
    kernel: str | None = None,
    graph_safe: bool = False,
    host_doc_ids: torch.Tensor | None = None,
) -> "DocumentMask | torch.Tensor":
    """The document mask for one forward over doc_ids [B, S]: a DocumentMask, or the dense boolean mask
    [B, 1, S, S] when the kernel is 'dense'. `kernel` overrides the choice document_kernel makes;
    graph_safe: the layers are compiled with fullgraph=True (see document_kernel). host_doc_ids: the same ids in
    host memory (the trainer's batch), where the document boundaries are found without a device-to-host sync
    (`nonzero` on a GPU tensor waits for the GPU)."""
    b, s = doc_ids.shape
    kernel = kernel or document_kernel(backend, doc_ids.device, dtype, b * s * s, graph_safe)
    if kernel == "dense":
        return causal_mask(s, s, doc_ids.device, doc_ids)
    block_mask = None
    if kernel == "flex":
        from torch.nn.attention.flex_attention import create_block_mask

        def same_doc_causal(bi, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (doc_ids[bi, q_idx] == doc_ids[bi, kv_idx])

        block_mask = create_block_mask(same_doc_causal, b, None, s, s, device=doc_ids.device)
    # on the host ids where given (a no-op .to when they are on doc_ids' device already)
    cu = cu_seqlens(doc_ids if host_doc_ids is None else host_doc_ids).to(doc_ids.device, non_blocking=True)
    if kernel == "varlen":  # a new document count must not recompile the layer that receives cu_seqlens
        torch._dynamo.mark_dynamic(cu, 0)
    return DocumentMask(cu, s, kernel, block_mask)


_compiled_flex = None


def _flex(q, k, v, block_mask, gqa):
    """FlexAttention; compiled on CUDA (eager flex materializes the scores), eager on CPU (forward only)."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    fn = flex_attention
    if q.is_cuda and not torch.compiler.is_compiling():  # inside a compiled layer flex is traced as it is
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention, dynamic=False)
        fn = _compiled_flex
    return fn(q, k, v, block_mask=block_mask, enable_gqa=gqa)


@torch.compiler.disable
def _flash_varlen(q, k, v, mask: DocumentMask):
    b, _, s, d = q.shape
    flat = [x.transpose(1, 2).reshape(b * s, x.shape[1], d) for x in (q, k, v)]  # [B*S, heads, D]
    out = _flash_attn_varlen_func(
        *flat,
        cu_seqlens_q=mask.cu_seqlens,
        cu_seqlens_k=mask.cu_seqlens,
        max_seqlen_q=mask.max_seqlen,
        max_seqlen_k=mask.max_seqlen,
        causal=True,
    )
    return out.view(b, s, -1, d).transpose(1, 2)


def _varlen(q, k, v, mask: DocumentMask, gqa: bool):
    """torch's varlen_attn over the flattened [B*S, heads, D] tokens (a custom op: traced by torch.compile)."""
    fn, causal, takes_gqa = _TORCH_VARLEN
    b, _, s, d = q.shape
    if gqa and not takes_gqa:  # older signature: repeat each kv head for its query group
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    flat = [x.transpose(1, 2).reshape(b * s, x.shape[1], d) for x in (q, k, v)]  # [B*S, heads, D]
    extra = {"enable_gqa": True} if gqa and takes_gqa else {}
    out = fn(*flat, mask.cu_seqlens, mask.cu_seqlens, mask.max_seqlen, mask.max_seqlen, **causal, **extra)
    return out.view(b, s, -1, d).transpose(1, 2)


@torch.compiler.disable
def _sdpa_per_doc(q, k, v, mask: DocumentMask, gqa: bool):
    b, _, s, d = q.shape
    flat = [x.transpose(0, 1).reshape(x.shape[1], b * s, d) for x in (q, k, v)]  # [heads, B*S, D]
    bounds = mask.cu_seqlens.tolist()
    outs = [
        F.scaled_dot_product_attention(*(x[:, lo:hi] for x in flat), is_causal=True, enable_gqa=gqa)
        for lo, hi in zip(bounds[:-1], bounds[1:])
    ]
    return torch.cat(outs, dim=1).view(-1, b, s, d).transpose(0, 1)


def _document_attention(q, k, v, mask: DocumentMask) -> torch.Tensor:
    gqa = q.shape[1] != k.shape[1]
    kernel = "sdpa_per_doc" if _FORCE_MATH else mask.kernel
    if kernel == "varlen":
        return _varlen(q, k, v, mask, gqa)
    if kernel == "flash_varlen":
        return _flash_varlen(q, k, v, mask)
    if kernel == "flex":
        return _flex(q, k, v, mask.block_mask, gqa)
    return _sdpa_per_doc(q, k, v, mask, gqa)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: "torch.Tensor | DocumentMask | None", backend: str = "auto"
) -> torch.Tensor:
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
