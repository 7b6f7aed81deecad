"""Gradient-norm clipping over parameters that live on different device meshes.

Under FSDP x TP the parameters are DTensors on two meshes: the TP-planned ones on the 2-D (dp, tp) mesh,
the rest (LM head, ...) on the 1-D dp mesh. `torch.nn.utils.get_total_norm` (and torchtitan's
clip_grad_norm_, which calls it on all gradients at once) cannot stack norms of DTensors on different
meshes, so this computes the norm per (mesh, placements) group, reduces each group to a plain scalar
(`full_tensor`, one all-reduce per group) and combines them: ‖g‖ = sqrt(Σ_groups ‖g_group‖²).
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DTensor


def _group_key(g: torch.Tensor):
    if isinstance(g, DTensor):
        return (id(g.device_mesh), tuple(g.placements))
    return None


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float, foreach: bool = False) -> torch.Tensor:
    """Clip the gradients of `parameters` in place to total L2 norm `max_norm`; returns the total norm."""
    grads = [p.grad for p in parameters if p.grad is not None]
    groups: dict = defaultdict(list)
    for g in grads:
        groups[_group_key(g)].append(g)
    total_sq = torch.zeros((), dtype=torch.float32)
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm(group, 2.0, False, foreach)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        total_sq += norm.float().cpu() ** 2
    total = total_sq.sqrt()
    if is_fake(total):  # the dry run's memory plan: no value to read; scaling in place allocates nothing
        return total
    coef = float(max_norm) / (float(total) + 1e-6)
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return total


@torch.no_grad()
def total_grad_norm(parameters) -> torch.Tensor:
    """The L2 norm of all gradients of `parameters` (on one mesh), reduced over the ranks that shard them; clips
    nothing (torch.nn.utils.clip_grads_with_norm_ does, once the caller has seen the norm is finite)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, 2.0, False, True)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


@torch.no_grad()
def nonfinite_grad_names(model) -> list[str]:
    """Names of the parameters whose local gradient shard holds a NaN or Inf: one foreach norm, one host read."""
    named = [(n, p.grad) for n, p in model.named_parameters() if p.requires_grad and p.grad is not None]
    if not named:
        return []
    local = [g.to_local() if hasattr(g, "to_local") else g for _, g in named]
    finite = torch.isfinite(torch.stack(torch._foreach_norm(local))).tolist()
    return [name for (name, _), ok in zip(named, finite) if not ok]
