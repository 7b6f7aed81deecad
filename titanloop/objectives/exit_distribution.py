"""The exit distribution p(t) of a LoopLM and the Q-exit rule (ouro §3.2, RECIPE §2).

    λ_t = sigmoid(z_t)                  instantaneous exit probability at loop t
    S_t = Π_{j<=t} (1 - λ_j), S_0 = 1   survival
    p(t) = λ_t S_{t-1}  (t < T),  p(T) = S_{T-1}
    Q-exit: the first t with CDF(t) = 1 - S_t >= q   (CDF(T) = 1)

Everything is computed in log space in fp32 so that long loops and saturated gates stay finite.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from titanloop.config_errors import require


def exit_log_probs(gate_logits: torch.Tensor) -> torch.Tensor:
    """gate_logits [T, ...] -> log p(t) [T, ...] (fp32); exp sums to 1 over dim 0."""
    z = gate_logits.float()
    log_lam = F.logsigmoid(z)
    log_cont = F.logsigmoid(-z)  # log(1 - λ)
    # log S_{t-1}: exclusive cumulative sum of log(1 - λ)
    log_surv_prev = torch.cumsum(log_cont, dim=0) - log_cont
    log_p = log_lam + log_surv_prev
    # the last loop takes the remaining mass S_{T-1}
    return torch.cat([log_p[:-1], log_surv_prev[-1:]], dim=0)


def exit_probs(gate_logits: torch.Tensor) -> torch.Tensor:
    return exit_log_probs(gate_logits).exp()


def exit_entropy(log_p: torch.Tensor) -> torch.Tensor:
    """H(p) over dim 0 from log p; [T, ...] -> [...]."""
    return -(log_p.exp() * log_p).sum(0)


def exit_cdf(gate_logits: torch.Tensor) -> torch.Tensor:
    """CDF(t) = 1 - S_t, with CDF(T) forced to 1; [T, ...]."""
    log_cont = F.logsigmoid(-gate_logits.float())
    cdf = 1.0 - torch.cumsum(log_cont, dim=0).exp()
    cdf[-1] = 1.0
    return cdf


def q_exit_steps(gate_logits: torch.Tensor, q: float) -> torch.Tensor:
    """Q-exit: 1-based loop index at which each token exits (the first t with CDF(t) >= q).

    q = 0 exits at loop 1, q = 1 runs to the last loop (unless a gate is exactly saturated).
    """
    require(0.0 <= q <= 1.0, "q", q, "a threshold in [0, 1]")
    reached = exit_cdf(gate_logits) >= q
    return reached.float().argmax(dim=0) + 1  # argmax returns the first True
