"""Per-token cross-entropy of a linear LM head, computed in chunks of tokens.

`linear_cross_entropy(hidden, weight, targets)` equals
`F.cross_entropy(hidden @ weight.T, targets, reduction='none')` but never holds more than
`chunk_size x vocab` logits: the forward keeps only the log-sum-exp per token, and the backward recomputes
each chunk's logits to form the gradient. A LoopLM decodes every loop with the same head, so a per-loop
objective at T loops costs T x (tokens x hidden) of saved activations instead of T x (tokens x vocab).

Logits and the softmax are formed in fp32 whatever the input dtype. Targets equal to `ignore_index` get loss 0
and no gradient.
"""

from __future__ import annotations

import torch

from titanloop.config_errors import require

IGNORE_INDEX = -100


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
            lse_c = torch.logsumexp(logits, dim=-1)
            tgt = logits.gather(1, safe_t[s:e, None]).squeeze(1)
            lse[s:e] = lse_c
            loss[s:e] = lse_c - tgt
        loss = torch.where(valid, loss, torch.zeros_like(loss))
        ctx.save_for_backward(hidden, weight, safe_t, valid, lse)
        ctx.chunk_size = chunk_size
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, safe_t, valid, lse = ctx.saved_tensors
        n = hidden.shape[0]
        g = (grad_loss.float() * valid.float())
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if ctx.needs_input_grad[1] else None
        for s in range(0, n, ctx.chunk_size):
            e = min(n, s + ctx.chunk_size)
            logits = (hidden[s:e] @ weight.t()).float()
            probs = torch.exp(logits - lse[s:e, None])
            probs.scatter_add_(1, safe_t[s:e, None], -torch.ones_like(probs[:, :1]))
            d_logits = probs * g[s:e, None]  # d loss / d logits
            if grad_h is not None:
                grad_h[s:e] = (d_logits.to(weight.dtype) @ weight).to(hidden.dtype)
            if grad_w is not None:
                grad_w += d_logits.t() @ hidden[s:e].float()
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         chunk_size: int = 4096, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """hidden [..., H], weight [V, H], targets [...] -> per-token CE [...] in fp32."""
    require(chunk_size >= 1, "chunk_size", chunk_size, "an integer >= 1")
    shape = targets.shape
    loss = _LinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1),
                                     int(chunk_size), ignore_index)
    return loss.view(shape)


def dense_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                        ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """The unchunked reference: materializes [..., V] logits. Used by tests and the naive benchmark row."""
    logits = (hidden @ weight.t()).float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                             reduction="none", ignore_index=ignore_index).view(targets.shape)


def per_loop_cross_entropy(readouts, weight: torch.Tensor, targets: torch.Tensor, chunk_size: int = 4096,
                           ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """L^(t) per token for every loop: readouts is a list of [B, S, H]; returns [T, B, S] fp32."""
    return torch.stack([linear_cross_entropy(r, weight, targets, chunk_size, ignore_index) for r in readouts])
