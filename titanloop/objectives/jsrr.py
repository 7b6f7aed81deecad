"""STARS Jacobian spectral-radius regularization (stars §5, Algorithm 1).

At loop state x_t (the input the next loop would receive), with Φ one application of the looped block
(including the inter-loop norm), draw v ~ N(0, I) per sample, normalize it over the sample's whole
[S, H] state, and run `power_steps` steps of power iteration with Jacobian-vector products:
    j = J_Φ(x_t) v;   v <- j / ‖j‖
L_JSRR = mean over samples of ‖j‖² from the last step (ρ(J) ≈ ‖j‖). The JVP uses forward-mode AD
(torch.func.jvp), so J is never formed; gradients flow to the parameters through j.
"""

from __future__ import annotations

import torch
from torch.func import jvp as _jvp

from titanloop.model.attention import math_attention


def jvp(phi, primals, tangents):
    with math_attention():  # fused attention kernels have no forward-mode AD
        return _jvp(phi, primals, tangents)


def _unit_per_sample(v: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    norm = v.flatten(1).norm(dim=1).view(-1, *([1] * (v.dim() - 1)))
    return v / (norm + eps)


def jsrr_loss(phi, x: torch.Tensor, power_steps: int = 1, generator: torch.Generator | None = None) -> torch.Tensor:
    """phi: callable x -> Φ(x) (same shape); x: [B, S, H]. Returns the scalar L_JSRR (fp32)."""
    v = torch.randn(x.shape, generator=generator, dtype=torch.float32, device="cpu").to(x.device, x.dtype)
    v = _unit_per_sample(v)
    j = None
    for step in range(power_steps):
        _, j = jvp(phi, (x,), (v,))
        if step + 1 < power_steps:
            v = _unit_per_sample(j.detach())
    return j.float().flatten(1).pow(2).sum(1).mean()


def spectral_radius_estimate(phi, x: torch.Tensor, power_steps: int = 10,
                             generator: torch.Generator | None = None) -> torch.Tensor:
    """Per-sample ρ(J) estimate ‖J v‖ after `power_steps` iterations (diagnostics, no grad)."""
    with torch.no_grad():
        v = _unit_per_sample(torch.randn(x.shape, generator=generator).to(x.device, x.dtype))
        rho = None
        for _ in range(power_steps):
            _, j = jvp(phi, (x,), (v,))
            rho = j.float().flatten(1).norm(dim=1)
            v = _unit_per_sample(j)
        return rho
