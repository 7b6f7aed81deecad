"""Per-step diagonal modulation of the recurrent layer's LoRA bases: the CompactController hypernetwork
(ouroboros §3.3, Algorithm 1) and the static per-step baseline.

Both return, for recurrence step t, one diagonal δ_{t,k} ∈ R^r per target k (q, k, v, o, gate, up, down),
shaped to broadcast against the [B, S, r] activation A_k x. Both start at zero (zero-initialized heads /
table), so step 0 of training runs the unmodified recurrent layer.

Pooling (the controller's view of the state). The paper pools over the whole sequence. For next-token
training that lets position i's weights depend on tokens i+1.., so the loss can be lowered by reading the
future (a leak the held-out evaluation does not reward), and in generation every new token would change
the weights already used for the cached prefix. `pooling="causal"` (default) gives position i the mean of
h_1..h_i of its own document: no leak, and a running sum makes it cacheable. `pooling="sequence"` is the
paper's whole-document mean, kept to reproduce the paper (docs/retrofit.md). Both respect doc_ids.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from titanloop.model.attention import document_positions
from titanloop.retrofit.config import TARGETS, RetrofitConfig


def mean_pool(x: torch.Tensor, doc_ids: torch.Tensor | None, causal: bool) -> torch.Tensor:
    """x [B, S, D] -> per-token pooled state [B, S, D] (sequence pooling without doc_ids: [B, 1, D])."""
    b, s, d = x.shape
    pos = torch.arange(s, device=x.device)
    if causal:
        csum = x.float().cumsum(1)
        if doc_ids is None:
            return (csum / (pos + 1)[None, :, None]).to(x.dtype)
        in_doc = document_positions(doc_ids)  # [B, S]: index within the token's document
        start = pos[None] - in_doc
        before = torch.cat([csum.new_zeros(b, 1, d), csum[:, :-1]], 1).gather(1, start[..., None].expand(-1, -1, d))
        return ((csum - before) / (in_doc + 1)[..., None]).to(x.dtype)
    if doc_ids is None:
        return x.mean(1, keepdim=True)
    idx = doc_ids - doc_ids.min(1, keepdim=True).values  # [B, S] in 0..n_docs-1
    n = int(idx.max()) + 1
    sums = x.float().new_zeros(b, n, d).scatter_add_(1, idx[..., None].expand(-1, -1, d), x.float())
    counts = x.float().new_zeros(b, n).scatter_add_(1, idx, torch.ones_like(idx, dtype=torch.float32))
    return (sums / counts[..., None]).gather(1, idx[..., None].expand(-1, -1, d)).to(x.dtype)


class CompactController(nn.Module):
    """δ_{t,k} = W_k StyleNet([SiLU(Proj(pool(h))); e_t]): Proj d -> 2s, step embedding e_t ∈ R^s,
    StyleNet 3s -> 2s -> s (SiLU), zero-initialized heads s -> r for the seven targets (one fused matrix)."""

    def __init__(self, hidden: int, style: int, rank: int, max_loops: int, causal: bool):
        super().__init__()
        self.hidden, self.style, self.rank, self.causal = hidden, style, rank, causal
        self.proj = nn.Linear(hidden, 2 * style)
        self.step_embed = nn.Embedding(max_loops, style)
        self.style_in = nn.Linear(3 * style, 2 * style)
        self.style_out = nn.Linear(2 * style, style)
        self.heads = nn.Linear(style, len(TARGETS) * rank)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        for lin in (self.proj, self.style_in, self.style_out):
            lin.reset_parameters()
        nn.init.normal_(self.step_embed.weight, std=1.0)
        nn.init.zeros_(self.heads.weight)  # zero heads: ΔW = 0 until training moves them
        nn.init.zeros_(self.heads.bias)

    def forward(self, x: torch.Tensor, t: int, doc_ids: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        z = F.silu(self.proj(mean_pool(x, doc_ids, self.causal)))
        e = self.step_embed.weight[t].expand(*z.shape[:-1], -1)
        u = self.style_out(F.silu(self.style_in(torch.cat([z, e], dim=-1))))
        return dict(zip(TARGETS, self.heads(u).split(self.rank, dim=-1)))

    def flops_per_token(self) -> float:
        """Forward matmul FLOPs per pooled position (per token with causal pooling)."""
        s = self.style
        return 2 * (self.hidden * 2 * s + 3 * s * 2 * s + 2 * s * s + s * len(TARGETS) * self.rank)


class StaticModulation(nn.Module):
    """The static per-step LoRA baseline: a learned diagonal per step and target, independent of the input."""

    def __init__(self, rank: int, max_loops: int):
        super().__init__()
        self.rank = rank
        self.deltas = nn.Parameter(torch.zeros(max_loops, len(TARGETS), rank))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.zeros_(self.deltas)

    def forward(self, x: torch.Tensor, t: int, doc_ids: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        return {k: self.deltas[t, i].view(1, 1, -1) for i, k in enumerate(TARGETS)}

    def flops_per_token(self) -> float:
        return 0.0


def build_modulation(cfg: RetrofitConfig, hidden: int) -> nn.Module | None:
    if cfg.modulation == "controller":
        return CompactController(hidden, cfg.style_dim, cfg.lora_rank, cfg.max_loops, cfg.pooling == "causal")
    if cfg.modulation == "static":
        return StaticModulation(cfg.lora_rank, cfg.max_loops)
    return None
