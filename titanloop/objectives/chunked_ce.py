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
        g = (grad_loss.float() * valid.float())
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = (torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if ctx.needs_input_grad[1]
                  else None)
        for s in range(0, n, ctx.chunk_size):
            e = min(n, s + ctx.chunk_size)
            # d loss / d logits = (softmax - onehot) * g, formed in place in the one [chunk, V] buffer
            d_logits = (hidden[s:e] @ weight.t()).float()
            d_logits.sub_(lse[s:e, None]).exp_()
            d_logits.scatter_add_(1, safe_t[s:e, None], -torch.ones_like(d_logits[:, :1]))
            d_logits.mul_(g[s:e, None])
            if grad_h is not None:
                grad_h[s:e] = (d_logits.to(weight.dtype) @ weight).to(hidden.dtype)
            if grad_w is not None:
                grad_w += d_logits.t() @ hidden[s:e].float()
            del d_logits
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
    """L^(t) per token for every loop: readouts is a list of [B, S, H]; returns [T, B, S] fp32.

    One call over the stacked loops, so the LM-head gradient is formed once rather than once per loop
    (separate calls would hold a second [V, H] fp32 buffer while autograd sums them). Chunks never exceed one
    loop's tokens, so the logits buffer is no larger than a final-loop-only CE would use."""
    stacked = torch.stack(list(readouts))
    chunk_size = min(chunk_size, max(1, targets.numel()))
    return linear_cross_entropy(stacked, weight, targets.expand(stacked.shape[:-1]), chunk_size, ignore_index)
