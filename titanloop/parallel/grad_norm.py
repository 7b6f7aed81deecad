"""Gradient-norm clipping over parameters that live on different device meshes.

Under FSDP x TP the parameters are DTensors on two meshes: the TP-planned ones on the 2-D (dp, tp) mesh,
the rest (LM head, ...) on the 1-D dp mesh. `torch.nn.utils.get_total_norm` (and torchtitan's
clip_grad_norm_, which calls it on all gradients at once) cannot stack norms of DTensors on different
meshes, so this computes the norm per (mesh, placements) group, reduces each group to a plain scalar
(`full_tensor`, one all-reduce per group) and combines them on the device: ‖g‖ = sqrt(Σ_groups ‖g_group‖²).
`clip_grads_` then scales each group with torch.nn.utils.clip_grads_with_norm_, so every layout clips the same
way: after the caller has seen the norm is finite.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.distributed.tensor import DTensor


def _group_key(g: torch.Tensor):
    if isinstance(g, DTensor):
        return (id(g.device_mesh), tuple(g.placements))
    return None


@torch.no_grad()
def total_grad_norm(parameters) -> torch.Tensor:
    """The L2 norm of all gradients of `parameters`, reduced over the ranks that shard them, as a plain tensor on
    the gradients' device; clips nothing (torch.nn.utils.clip_grads_with_norm_ does, once the caller has seen the
    norm is finite). Gradients on one mesh (or plain tensors) take one foreach norm; DTensors on several meshes
    (FSDP x TP) one per (mesh, placements) group, each reduced to a plain scalar, combined as
    sqrt(sum of squares)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    groups: dict = defaultdict(list)
    for g in grads:
        groups[_group_key(g)].append(g)
    norms = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm(group, 2.0, False, True)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if len(norms) <= 1:  # no gradients at all: a norm of 0, as get_total_norm gives for an empty list
        return norms[0] if norms else torch.zeros(())
    return torch.stack([n.float() for n in norms]).pow(2).sum().sqrt()


@torch.no_grad()
def clip_grads_(parameters, max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale the gradients of `parameters` in place by min(1, max_norm / total_norm), one foreach call per (mesh,
    placements) group (a foreach op takes DTensors of one mesh); no host read, so fake tensors plan it too."""
    groups: dict = defaultdict(list)
    for p in parameters:
        if p.grad is not None:
            groups[_group_key(p.grad)].append(p)
    for group in groups.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total_norm, foreach=True)


@torch.no_grad()
def nonfinite_grad_names(model) -> list[str]:
    """Names of the parameters whose local gradient shard holds a NaN or Inf: one foreach norm, one host read."""
    named = [(n, p.grad) for n, p in model.named_parameters() if p.requires_grad and p.grad is not None]
    if not named:
        return []
    local = [g.to_local() if hasattr(g, "to_local") else g for _, g in named]
    finite = torch.isfinite(torch.stack(torch._foreach_norm(local))).tolist()
    return [name for (name, _), ok in zip(named, finite) if not ok]
