"""STARS Jacobian spectral-radius regularization (stars §5, Algorithm 1).

At loop state x_t (the input the next loop would receive), with Φ one application of the looped block
(including the inter-loop norm), draw v ~ N(0, I) per sample (`jsrr_probes`: a function of the run's seed
and the sample's global index, so every data-parallel rank probes its own directions and a resumed run, at
any world size, draws the same ones), normalize it over the sample's whole [S, H] state, and run
`power_steps` steps of power iteration with Jacobian-vector products:
    j = J_Φ(x_t) v;   v <- j / ‖j‖
L_JSRR = mean over samples of ‖j‖² from the last step (ρ(J) ≈ ‖j‖). The JVP uses forward-mode AD
(torch.func.jvp), so J is never formed; gradients flow to the parameters through j.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.func import jvp as _jvp

from titanloop.model.attention import math_attention


def jvp(phi, primals, tangents):
    with math_attention():  # fused attention kernels have no forward-mode AD
        return _jvp(phi, primals, tangents)


def _unit_per_sample(v: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    norm = v.flatten(1).norm(dim=1).view(-1, *([1] * (v.dim() - 1)))
    return v / (norm + eps)


def jsrr_target(model, out, input_ids, doc_ids, n_loops: int):
    """(Φ, state) for JSRR (stars §5, Alg. 1): the map of loop T+1 at the state after T loops, x_T. With
    per-loop norms at T == max_loops there is no loop T+1; then the last loop the forward ran, Φ_{T-1} at its
    input x_{T-1}. Either way Φ(state) is a transition the model computes. Φ is closed over RoPE and the mask."""
    cos, sin, mask = model.rope_and_mask(input_ids, doc_ids=doc_ids)
    if model.loop_norms is not None and n_loops >= len(model.loop_norms):
        t, state = n_loops - 1, out.last_input
    else:
        t, state = n_loops, out.next_input
    return (lambda x: model.recurrent_map(x, t, cos, sin, mask)), state


def jsrr_probes(shape, sample_ids: torch.Tensor, seed: int) -> torch.Tensor:
    """[B, *shape[1:]] fp32 N(0, I) directions on CPU, row i drawn from a generator seeded with (seed,
    sample_ids[i]) only: independent of the rank, the world size and the batch a sample lands in."""
    rows = [
        np.random.default_rng([int(seed), int(sid)]).standard_normal(tuple(shape[1:]), dtype=np.float32)
        for sid in sample_ids.tolist()
    ]
    return torch.from_numpy(np.stack(rows))


def jsrr_loss(phi, x: torch.Tensor, probes: torch.Tensor, power_steps: int = 1) -> torch.Tensor:
    """phi: callable x -> Φ(x) (same shape); x: [B, S, H]; probes: the starting directions (x's shape, e.g.
    from jsrr_probes). Returns the scalar L_JSRR (fp32)."""
    v = _unit_per_sample(probes.to(x.device, x.dtype))
    j = None
    for step in range(power_steps):
        _, j = jvp(phi, (x,), (v,))
        if step + 1 < power_steps:
            v = _unit_per_sample(j.detach())
    return j.float().flatten(1).pow(2).sum(1).mean()


def spectral_radius_estimate(
    phi, x: torch.Tensor, power_steps: int = 10, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Per-sample ρ(J) estimate ‖J v‖ after `power_steps` iterations (diagnostics, no grad)."""
    with torch.no_grad():
        v = _unit_per_sample(torch.randn(x.shape, generator=generator).to(x.device, x.dtype))
        rho = None
        for _ in range(power_steps):
            _, j = jvp(phi, (x,), (v,))
            rho = j.float().flatten(1).norm(dim=1)
            v = _unit_per_sample(j)
        return rho
