"""Per-token cross-entropy of a linear LM head, computed in chunks of tokens.

`linear_cross_entropy(hidden, weight, targets)` equals
`F.cross_entropy(hidden @ weight.T, targets, reduction='none')` but never holds more than
`chunk_size x vocab` logits: the forward keeps only the log-sum-exp per token, and the backward recomputes
each chunk's logits to form the gradient. A LoopLM decodes every loop with the same head, so a per-loop
objective at T loops costs T x (tokens x hidden) of saved activations instead of T x (tokens x vocab).

`fused_per_loop_cross_entropy(readouts, weight, targets, loop_weights)` is the readout of a loss that is linear
in the per-loop CE, Σ_t,b,s w[t,b,s] L^(t)[b,s] (Stage I, dense, final-only: titanloop.objectives.objective).
Because each token's gradient factor w is known in the forward, it forms each chunk's logits once and derives
the CE, the gradient w.r.t. the readout and the LM head's gradient from them at once: 3 head matmuls per loop
instead of the 4 of the recompute path. The price: the LM head's gradient ([V, H] in the weight's dtype) is held
from forward to backward, where the recompute path allocates a [V, H] fp32 buffer only in backward.

Logits and the softmax are formed in fp32 whatever the input dtype. Targets equal to `ignore_index` get loss 0
and no gradient.
"""

from __future__ import annotations

import warnings

import torch

from titanloop.config_errors import require

IGNORE_INDEX = -100


def _add_head_grad_bf16(grad_w: torch.Tensor, d_logits_lp: torch.Tensor, hidden: torch.Tensor) -> bool:
    """grad_w (fp32) += d_logits_lp^T @ hidden as one bf16 GEMM with fp32 accumulation, written into grad_w in
    place (torch's `out_dtype`, CUDA only); False where that does not apply, and the caller forms it in fp32.

    On one H100 the fp32 form of this product ran as a SIMT GEMM at 52 TFLOP/s and took 15% of the 1.4B
    training step (its profile). d_logits_lp is the chunk's logit gradient already rounded to bf16 for the readout
    gradient (d_logits @ W), so both gradients see the same rounding, as in a bf16 LM head."""
    if not (hidden.is_cuda and hidden.dtype == d_logits_lp.dtype == torch.bfloat16 and _BF16_HEAD_GRAD[0]):
        return False
    try:
        torch.addmm(grad_w, d_logits_lp.t(), hidden, out_dtype=torch.float32, out=grad_w)
    except (RuntimeError, TypeError) as e:  # a torch without the out_dtype overload: fp32 from now on, said once
        _BF16_HEAD_GRAD[0] = False
        warnings.warn(f"bf16 LM-head gradient GEMM unavailable ({type(e).__name__}: {e}); using fp32", stacklevel=2)
        return False
    return True


_BF16_HEAD_GRAD = [True]  # cleared for the process when torch lacks addmm's out_dtype (then fp32, as before)


def _logsumexp_(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise log-sum-exp that overwrites `logits` (torch.logsumexp would allocate a second [chunk, V])."""
    m = logits.amax(dim=-1, keepdim=True)
    return logits.sub_(m).exp_().sum(dim=-1).log_().add_(m.squeeze(-1))


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_size, ignore_index):
        n = hidden.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        loss = torch.empty(n, dtype=torch.float32, device=hidden.device)
        valid = targets != ignore_index
        safe_t = torch.where(valid, targets, torch.zeros_like(targets))
        for s in range(0, n, chunk_size):
            e = min(n, s + chunk_size)
            logits = (hidden[s:e] @ weight.t()).float()
            tgt = logits.gather(1, safe_t[s:e, None]).squeeze(1)
            lse[s:e] = _logsumexp_(logits)
            loss[s:e] = lse[s:e] - tgt
            del logits  # free this chunk before the next one is allocated (else two are alive at once)
        loss = torch.where(valid, loss, torch.zeros_like(loss))
        ctx.save_for_backward(hidden, weight, safe_t, valid, lse)
        ctx.chunk_size = chunk_size
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, safe_t, valid, lse = ctx.saved_tensors
        n = hidden.shape[0]
        g = grad_loss.float() * valid.float()
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if ctx.needs_input_grad[1] else None
        )
        for s in range(0, n, ctx.chunk_size):
            e = min(n, s + ctx.chunk_size)
            # d loss / d logits = (softmax - onehot) * g, formed in place in the one [chunk, V] buffer
            d_logits = (hidden[s:e] @ weight.t()).float()
            d_logits.sub_(lse[s:e, None]).exp_()
            d_logits.scatter_add_(1, safe_t[s:e, None], -torch.ones_like(d_logits[:, :1]))
            d_logits.mul_(g[s:e, None])
            d_lp = d_logits.to(weight.dtype)
            if grad_h is not None:
                grad_h[s:e] = (d_lp @ weight).to(hidden.dtype)
            if grad_w is not None and not _add_head_grad_bf16(grad_w, d_lp, hidden[s:e]):
                grad_w += d_logits.t() @ hidden[s:e].float()
            del d_logits, d_lp
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None, None


class _WeightedLinearCrossEntropy(torch.autograd.Function):
    """(Σ_n w_n L_n, L) with the gradients of the sum formed in the forward, chunk by chunk.

    d(Σ w L)/d logits_n = w_n (softmax_n − onehot_n): per chunk, gradient w.r.t. hidden = that @ W and the LM
    head's gradient += that^T @ hidden. The backward only scales them by the upstream scalar; the gradient
    w.r.t. w is L. L is returned detached (not differentiable)."""

    @staticmethod
    def forward(ctx, hidden, weight, w, targets, chunk_size, ignore_index):
        need_h, need_w, need_wts = ctx.needs_input_grad[:3]
        n = hidden.shape[0]
        loss = torch.empty(n, dtype=torch.float32, device=hidden.device)
        valid = targets != ignore_index
        safe_t = torch.where(valid, targets, torch.zeros_like(targets))
        g = w.detach().float() * valid.float()  # ignored tokens: loss 0, no gradient
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        for s in range(0, n, chunk_size):
            e = min(n, s + chunk_size)
            logits = (hidden[s:e] @ weight.t()).float()
            tgt = logits.gather(1, safe_t[s:e, None]).squeeze(1)
            m = logits.amax(dim=-1, keepdim=True)
            z = logits.sub_(m).exp_()  # in place: exp(logits − max), the one [chunk, V] buffer
            denom = z.sum(dim=-1, keepdim=True)
            loss[s:e] = denom.squeeze(1).log() + m.squeeze(1) - tgt
            if need_h or need_w:  # d(w L)/d logits = w (softmax − onehot), in place in the same buffer
                z.div_(denom).scatter_add_(1, safe_t[s:e, None], -torch.ones_like(z[:, :1])).mul_(g[s:e, None])
                z_lp = z.to(weight.dtype)
                if need_h:
                    grad_h[s:e] = (z_lp @ weight).to(hidden.dtype)
                if need_w and not _add_head_grad_bf16(grad_w, z_lp, hidden[s:e]):
                    grad_w.addmm_(z.t(), hidden[s:e].float())
                del z_lp
            del logits, z  # free this chunk before the next one is allocated (else two are alive at once)
        loss = torch.where(valid, loss, torch.zeros_like(loss))
        total = (g * loss).sum()
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        ctx.mark_non_differentiable(loss)
        ctx.chunk_size = chunk_size
        ctx.save_for_backward(grad_h, grad_w, loss if need_wts else None)
        return total, loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_total, _grad_loss):
        grad_h, grad_w, loss = ctx.saved_tensors
        scale = grad_total.float()
        return (
            _scaled(grad_h, scale, ctx.chunk_size),
            _scaled(grad_w, scale, ctx.chunk_size),
            None if loss is None else loss * scale,
            None,
            None,
            None,
        )


def _scaled(x: torch.Tensor | None, scale: torch.Tensor, chunk_size: int) -> torch.Tensor | None:
    """x * scale with the product formed in fp32 (a bf16 scale such as 1/accum would be rounded), chunk by chunk
    so that no fp32 copy of a whole bf16 x is alive."""
    if x is None or x.dtype == torch.float32:
        return None if x is None else x * scale
    out = torch.empty_like(x)
    for s in range(0, x.shape[0], chunk_size):
        out[s : s + chunk_size] = x[s : s + chunk_size].float() * scale
    return out


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_size: int = 4096,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """hidden [..., H], weight [V, H], targets [...] -> per-token CE [...] in fp32."""
    require(chunk_size >= 1, "chunk_size", chunk_size, "an integer >= 1")
    shape = targets.shape
    loss = _LinearCrossEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1), int(chunk_size), ignore_index
    )
    return loss.view(shape)


def dense_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """The unchunked reference: materializes [..., V] logits. Used by tests and the naive benchmark row."""
    logits = (hidden @ weight.t()).float()
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none", ignore_index=ignore_index
    ).view(targets.shape)


def per_loop_cross_entropy(
    readouts, weight: torch.Tensor, targets: torch.Tensor, chunk_size: int = 4096, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """L^(t) per token for every loop: readouts is a list of [B, S, H]; returns [T, B, S] fp32.

    One call over the stacked loops, so the LM-head gradient is formed once rather than once per loop
    (separate calls would hold a second [V, H] fp32 buffer while autograd sums them). Chunks never exceed one
    loop's tokens, so the logits buffer is no larger than a final-loop-only CE would use."""
    stacked = torch.stack(list(readouts))
    chunk_size = min(chunk_size, max(1, targets.numel()))
    return linear_cross_entropy(stacked, weight, targets.expand(stacked.shape[:-1]), chunk_size, ignore_index)


def fused_per_loop_cross_entropy(
    readouts,
    weight: torch.Tensor,
    targets: torch.Tensor,
    loop_weights: torch.Tensor,
    chunk_size: int = 4096,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ_t,b,s w[t,b,s] L^(t)[b,s], L) for readouts, a list of T [B, S, H], and loop_weights [T, B, S].

    Returns the fp32 scalar, differentiable w.r.t. the readouts, the LM head and loop_weights, and the per-loop
    CE L [T, B, S] fp32, detached. Values and gradients equal `(loop_weights * per_loop_cross_entropy(...)).sum()`
    within rounding, but each loop's logits are formed once (see the module docstring)."""
    require(chunk_size >= 1, "chunk_size", chunk_size, "an integer >= 1")
    stacked = torch.stack(list(readouts))
    shape = stacked.shape[:-1]
    require(
        tuple(loop_weights.shape) == tuple(shape),
        "loop_weights",
        tuple(loop_weights.shape),
        f"the shape [T, B, S] = {list(shape)} of the stacked readouts",
    )
    chunk_size = min(chunk_size, max(1, targets.numel()))
    total, loss = _WeightedLinearCrossEntropy.apply(
        stacked.reshape(-1, stacked.shape[-1]),
        weight,
        loop_weights.reshape(-1),
        targets.expand(shape).reshape(-1),
        int(chunk_size),
        ignore_index,
    )
    return total, loss.view(shape)
