"""The looped-LM training objectives (RECIPE §3), each a function of per-loop quantities.

Inputs are per-token tensors stacked over loops: `ce` [T, B, S] (L^(t) from per_loop_cross_entropy),
`gate_logits` [T, B, S], and a token mask [B, S] (False for ignored targets). Every loss averages over valid
tokens. All arithmetic is fp32.

- stage1_loss:       Σ_t p(t) L^(t) − β H(p)   (ouro eq. 4), or + β KL(p‖geometric(η)) (ouro appendix A)
- stage2_gate_loss:  adaptive exit loss, LM losses detached (ouro eqs. 5–6)
- dense_supervision_loss: ℓ(z_K) + α Σ_{k<K} w_k ℓ(z_k)  (DICE eq. 2; uniform | linear | exponential)
- scale_penalty:     λ (1/K) Σ_k E‖H_k‖²_rms  (readout-blind-spot §3)
- fixed point:       λ E‖u_{T+1} − u_T‖² / ‖u_T‖², the change one more loop makes (titanloop's own; objective.py)
- final_loop_loss:   plain CE of the last loop (the non-looped baseline objective)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from titanloop.config_errors import require, require_choice
from titanloop.objectives.exit_distribution import exit_entropy, exit_log_probs

OBJECTIVES = ("stage1", "stage2_gate", "dense", "final_only")
PRIORS = ("uniform", "geometric")
DENSE_SCHEDULES = ("uniform", "linear", "exponential")
DENSE_REDUCTIONS = ("sum", "mean")
CE_BACKWARDS = ("fused", "recompute")


@dataclass
class ObjectiveConfig:
    """Which objective a run optimizes and its hyper-parameters (RECIPE §3 defaults)."""

    name: str = "stage1"  # stage1 | stage2_gate | dense | final_only
    beta: float = 0.1  # stage1 entropy / KL weight (0.1 in stage 1a, 0.05 after)
    prior: str = "uniform"  # stage1: uniform (eq. 4) | geometric (KL to a truncated geometric prior)
    geometric_eta: float = 0.5
    gate_k: float = 50.0  # stage2 slope
    gate_gamma: float = 0.005  # stage2 threshold
    dense_alpha: float = 1.0  # DICE weight of the intermediate loops
    dense_schedule: str = "uniform"  # uniform | linear | exponential
    # dense: "sum" is DICE's l(z_K) + α Σ w_k l(z_k); "mean" divides it by 1 + α, the sum of the coefficients
    # (uniform with α = K - 1: the mean of the K per-loop CEs, as readout-blind-spot §3 averages them)
    dense_reduction: str = "sum"
    scale_penalty: float = 0.0  # λ of the scale penalty (0.01 in the paper); 0 = off
    jsrr_weight: float = 0.0  # STARS λ; 0 = off. total = (1-λ) CE + λ JSRR
    # λ of the fixed-point penalty: the squared relative change one more loop would make to the state the loops
    # pass on (LoopLM.loop_change), averaged over tokens; it asks the map to hold the state where the loss
    # is taken, so that loops past the trained depth leave it there. 0 = off
    fixed_point_weight: float = 0.0
    jsrr_power_steps: int = 1
    ce_chunk_size: int = 4096  # tokens per chunk of the per-loop cross-entropy
    # fused: each loop's logits are formed once, the LM-head gradient in the forward (holds a [V, H] gradient
    # from forward to backward); recompute: the backward recomputes every loop's logits (one more head matmul
    # per loop). Stage II needs no CE gradient either way.
    ce_backward: str = "fused"

    def __post_init__(self):
        self.validate()

    def validate(self):
        require_choice(self.name, "objective.name", OBJECTIVES)
        require(self.beta >= 0, "objective.beta", self.beta, "a value >= 0")
        require_choice(self.prior, "objective.prior", PRIORS)
        require(0 < self.geometric_eta < 1, "objective.geometric_eta", self.geometric_eta, "a value in (0, 1)")
        require(self.gate_k > 0, "objective.gate_k", self.gate_k, "a slope k > 0")
        require(self.dense_alpha >= 0, "objective.dense_alpha", self.dense_alpha, "a value >= 0")
        require_choice(self.dense_schedule, "objective.dense_schedule", DENSE_SCHEDULES)
        require_choice(self.dense_reduction, "objective.dense_reduction", DENSE_REDUCTIONS)
        require(self.scale_penalty >= 0, "objective.scale_penalty", self.scale_penalty, "a value >= 0")
        require(0 <= self.jsrr_weight <= 1, "objective.jsrr_weight", self.jsrr_weight, "a value in [0, 1]")
        require(self.fixed_point_weight >= 0, "objective.fixed_point_weight", self.fixed_point_weight, "a value >= 0")
        require(self.jsrr_power_steps >= 1, "objective.jsrr_power_steps", self.jsrr_power_steps, "an integer >= 1")
        require(self.ce_chunk_size >= 1, "objective.ce_chunk_size", self.ce_chunk_size, "an integer >= 1")
        require_choice(self.ce_backward, "objective.ce_backward", CE_BACKWARDS)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of x [..., B, S] over valid tokens (mask [B, S]); leading dims are kept."""
    m = mask.to(x.dtype)
    return (x * m).sum(dim=(-2, -1)) / m.sum().clamp_min(1.0)


def token_weights(mask: torch.Tensor) -> torch.Tensor:
    """w [B, S] fp32 with Σ w x = masked_mean(x, mask): 1 / n_valid on valid tokens, 0 on ignored ones."""
    m = mask.float()
    return m / m.sum().clamp_min(1.0)


def geometric_prior(n_loops: int, eta: float, device=None) -> torch.Tensor:
    """π(t) ∝ η (1-η)^(t-1), t = 1..T, normalized over the T loops (larger η favours early exit)."""
    t = torch.arange(n_loops, dtype=torch.float32, device=device)
    w = eta * (1 - eta) ** t
    return w / w.sum()


def stage1_loss(
    ce: torch.Tensor,
    gate_logits: torch.Tensor,
    mask: torch.Tensor,
    beta: float,
    prior: str = "uniform",
    eta: float = 0.5,
) -> tuple[torch.Tensor, dict]:
    """Ouro Stage I: per token Σ_t p(t) L^(t) − β H(p) (uniform prior, eq. 4) or + β KL(p‖π) (geometric)."""
    log_p = exit_log_probs(gate_logits)
    p = log_p.exp()
    expected = (p * ce.float()).sum(0)
    entropy = exit_entropy(log_p)
    reg = _stage1_regularizer(log_p, entropy, prior, eta)
    loss = masked_mean(expected + beta * reg, mask)
    stats = {
        "expected_ce": masked_mean(expected, mask).detach(),
        "gate_entropy": masked_mean(entropy, mask).detach(),
        "exit_prob": masked_mean(p, mask).detach(),
    }
    return loss, stats


def _stage1_regularizer(log_p: torch.Tensor, entropy: torch.Tensor, prior: str, eta: float) -> torch.Tensor:
    """Per token: −H(p) (uniform prior) or KL(p‖geometric(η))."""
    if prior == "uniform":
        return -entropy
    log_pi = geometric_prior(log_p.shape[0], eta, log_p.device).log().view(-1, *([1] * (log_p.dim() - 1)))
    return (log_p.exp() * (log_p - log_pi)).sum(0)


def stage1_linear_terms(
    gate_logits: torch.Tensor, mask: torch.Tensor, beta: float, prior: str = "uniform", eta: float = 0.5
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage I as Σ_t,b,s w L^(t) + r: w = p(t) / n_valid [T, B, S] (0 on ignored tokens) and r = β times the
    mean regularizer (scalar), both differentiable w.r.t. the gate logits. stage1_loss(ce, ...) equals
    (w * ce).sum() + r within rounding; the fused readout needs w before the CE exists."""
    log_p = exit_log_probs(gate_logits)
    reg = _stage1_regularizer(log_p, exit_entropy(log_p), prior, eta)
    return log_p.exp() * token_weights(mask), masked_mean(beta * reg, mask)


def stage2_gate_loss(
    ce: torch.Tensor, gate_logits: torch.Tensor, mask: torch.Tensor, k: float = 50.0, gamma: float = 0.005
) -> torch.Tensor:
    """Ouro Stage II adaptive exit loss (eqs. 5–6): the LM losses are detached, only the gate learns.

    I^(t) = max(0, L^(t-1) − L^(t)); w^(t) = σ(k (I^(t) − γ));
    L^(t) = −mean_i [w log(1 − λ_t) + (1 − w) log λ_t];  total = (1/T_max) Σ_{t=2..T_max} L^(t)
    (the paper's normalization, ouro §3.4, divides by T_max rather than T_max − 1).
    """
    n_loops = ce.shape[0]
    require(n_loops >= 2, "n_loops", n_loops, ">= 2 for the Stage II gate loss (it compares consecutive loops)")
    ce = ce.detach().float()
    improvement = (ce[:-1] - ce[1:]).clamp_min(0.0)  # I^(t) for t = 2..T
    w = torch.sigmoid(k * (improvement - gamma))
    z = gate_logits[1:].float()
    log_lam = torch.nn.functional.logsigmoid(z)
    log_cont = torch.nn.functional.logsigmoid(-z)
    per_step = masked_mean(-(w * log_cont + (1 - w) * log_lam), mask)  # [T-1]
    return per_step.sum() / n_loops


def dense_weights(n_loops: int, schedule: str, device=None) -> torch.Tensor:
    """Normalized weights w_k for the K-1 intermediate loops k = 1..K-1 (DICE): uniform, w_k ∝ k, w_k ∝ 2^k."""
    require_choice(schedule, "dense_schedule", DENSE_SCHEDULES)
    k = torch.arange(1, n_loops, dtype=torch.float32, device=device)
    if k.numel() == 0:
        return k
    if schedule == "uniform":
        w = torch.ones_like(k)
    elif schedule == "linear":
        w = k
    else:
        w = torch.pow(2.0, k)
    return w / w.sum()


def dense_loop_coefficients(
    n_loops: int, alpha: float, schedule: str, device=None, reduction: str = "sum"
) -> torch.Tensor:
    """c [T] with DICE's loss = Σ_t c_t mean(L^(t)): α w_k for the intermediate loops, 1 for the last; divided by
    their sum with reduction "mean" (1 + α, or 1 at T = 1, where there is no intermediate loop)."""
    require_choice(reduction, "dense_reduction", DENSE_REDUCTIONS)
    c = torch.cat([alpha * dense_weights(n_loops, schedule, device), torch.ones(1, device=device)])
    return c / c.sum() if reduction == "mean" else c


def dense_supervision_loss(
    ce: torch.Tensor, mask: torch.Tensor, alpha: float, schedule: str, reduction: str = "sum"
) -> torch.Tensor:
    """DICE eq. 2: ℓ(z_K) + α Σ_{k<K} w_k ℓ(z_k) with one shared readout (divided by 1 + α with "mean")."""
    per_loop = masked_mean(ce.float(), mask)  # [T]
    return (dense_loop_coefficients(ce.shape[0], alpha, schedule, ce.device, reduction) * per_loop).sum()


def final_loop_loss(ce_last: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return masked_mean(ce_last.float(), mask)


def rms_sq(h: torch.Tensor) -> torch.Tensor:
    """‖h‖²_rms per token: mean of squares over the hidden dimension."""
    return h.float().pow(2).mean(-1)


def scale_penalty(states, mask: torch.Tensor, weight: float) -> torch.Tensor:
    """readout-blind-spot §3: λ (1/K) Σ_k E‖H_k‖²_rms over valid tokens, states a list of [B, S, H]."""
    return weight * torch.stack([masked_mean(rms_sq(h), mask) for h in states]).mean()


def uniform_prior_kl_constant(n_loops: int) -> float:
    """KL(p‖uniform) = −H(p) + log T: the constant separating eq. 4 from the ELBO form."""
    return math.log(n_loops)
