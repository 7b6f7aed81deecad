"""Per-loop diagnostics (RECIPE §5): hidden-state scale, radial-gradient fraction, exit distribution, JSRR.

- hidden RMS norm of the raw state H_t per real token: mean, median, p99, max (readout-blind-spot §4).
- radial-gradient fraction r_t = <∇_H L_t, H_t> / (||∇_H L_t|| ||H_t||) per scored token, where L_t is the CE
  of loop t's readout in one forward at the deepest swept depth (readout-blind-spot Table 3: ~1e-8 for RMSNorm
  readouts, ~1e-2 for raw readouts); reported as mean |r|, median |r| and signed mean.
- exit distribution p(t) over the trained depth (ouro §3.2): mean p per loop, mean exit loop E[t], entropy.
- spectral radius ρ(J_Φ) of the recurrent map at the input of chosen loops (stars §5; power iteration).
"""

from __future__ import annotations

import torch

from titanloop.eval.stats import LoopStats
from titanloop.eval.trace import iter_loops
from titanloop.model import LoopLM
from titanloop.objectives import IGNORE_INDEX, exit_entropy, exit_log_probs, linear_cross_entropy
from titanloop.objectives import spectral_radius_estimate


def _on_device(batch: dict, model: LoopLM) -> dict:
    """The batch's tensors on the model's device (the eval keeps batches on the CPU)."""
    device = model.embed_tokens.weight.device
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _summary(x: torch.Tensor) -> dict:
    x = x.float()
    if x.numel() == 0:
        return {"mean": float("nan"), "median": float("nan"), "p99": float("nan"), "max": float("nan")}
    return {
        "mean": float(x.mean()),
        "median": float(x.median()),
        "p99": float(torch.quantile(x[:1_000_000], 0.99)),
        "max": float(x.max()),
    }


def hidden_norms(stats: LoopStats) -> list[dict]:
    return [{"loop": t + 1, **_summary(stats.state_rms[t])} for t in range(stats.n_loops)]


def exit_distribution(stats: LoopStats, exit_loops: int) -> dict:
    log_p = exit_log_probs(stats.gate_logits[:exit_loops])  # [T, N]
    p = log_p.exp()
    loops = torch.arange(1, exit_loops + 1, dtype=torch.float32)[:, None]
    return {
        "exit_loops": exit_loops,
        "p_mean": p.mean(1).tolist(),
        "mean_exit_loop": float((p * loops).sum(0).mean()),
        "entropy_mean": float(exit_entropy(log_p).mean()),
        "entropy_max": float(torch.log(torch.tensor(float(exit_loops)))),
    }


def radial_gradient_fraction(model: LoopLM, batch: dict, n_loops: int, chunk_size: int = 1024) -> list[dict]:
    """r_t per loop on one batch (module docstring); a backward through the readout path only."""
    batch = _on_device(batch, model)
    ids, labels, doc_ids = batch["input_ids"], batch["labels"], batch.get("doc_ids")
    scored = labels != IGNORE_INDEX
    cos, sin, mask = model.rope_and_mask(ids, doc_ids=doc_ids)
    with torch.no_grad():
        states = [s.state for s in iter_loops(model, ids, n_loops, doc_ids=doc_ids)]
    out = []
    for t, h in enumerate(states):
        h = h.detach().requires_grad_(True)
        with torch.enable_grad():
            pre = model.head_input(h, t, cos, sin, mask)
            readout = model.readout(pre, model.norm(pre), t, n_loops)
            loss = linear_cross_entropy(readout, model.lm_head.weight, labels, chunk_size).sum()
            (grad,) = torch.autograd.grad(loss, h)
        g, hv = grad[scored].float(), h.detach()[scored].float()
        r = (g * hv).sum(-1) / (g.norm(dim=-1) * hv.norm(dim=-1)).clamp_min(1e-30)
        out.append(
            {
                "loop": t + 1,
                "mean_abs": float(r.abs().mean()),
                "median_abs": float(r.abs().median()),
                "mean_signed": float(r.mean()),
            }
        )
    return out


def spectral_radius(
    model: LoopLM, batch: dict, loops: list[int], rows: int = 2, power_steps: int = 10, seed: int = 0
) -> list[dict]:
    """ρ(J_Φ) at the input x_{t-1} of each loop t in `loops`, on the first `rows` rows of `batch`."""
    batch = _on_device(batch, model)
    ids = batch["input_ids"][:rows]
    doc_ids = batch["doc_ids"][:rows] if batch.get("doc_ids") is not None else None
    cos, sin, mask = model.rope_and_mask(ids, doc_ids=doc_ids)
    wanted = sorted(set(int(t) for t in loops))
    inputs = {}
    with torch.no_grad():
        for step in iter_loops(model, ids, max(wanted), doc_ids=doc_ids):
            if step.t in wanted:
                inputs[step.t] = step.loop_input
    out = []
    for t in wanted:
        gen = torch.Generator().manual_seed(seed + t)
        phi = lambda x, t=t: model.recurrent_map(x, t - 1, cos, sin, mask)  # noqa: E731
        rho = spectral_radius_estimate(phi, inputs[t], power_steps=power_steps, generator=gen)
        out.append({"loop": t, "rho_mean": float(rho.mean()), "rho_max": float(rho.max())})
    return out
