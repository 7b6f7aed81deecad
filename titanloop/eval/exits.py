"""Early-exit rules and the compute-quality (Pareto) frontier (ouro §5.4.1, Fig. 5; dice §2; readout App. H).

Every rule maps per-token, per-loop signals [T, N] to a 1-based exit loop per token [N]; a token whose rule
never fires runs to the last loop T. Rules (per token, teacher-forced scoring):
    static(t)               exit at t
    q_exit(q)               first t with CDF(t) = 1 - S_t >= q (ouro §3.2); q in [0, 1]
    hidden_diff(eps)        first t >= 2 with ||x_t - x_{t-1}||_rms < eps (ouro §5.4.1)
    logit_margin(tau)       first t with p_t(top-1) - p_t(top-2) >= tau; tau in [0, 1]
    ash(eps, m)             first t at which ||p_s - p_{s-1}||_1 < eps held for the m consecutive loops
                            s = t-m+1..t (dice §2); eps in [0, 2]
An operating point is (average loops used, quality at each token's exit loop); the frontier keeps the points
no other point beats on both.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from titanloop.config_errors import require
from titanloop.eval.stats import LoopStats

DEFAULT_Q = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
DEFAULT_MARGIN = (0.0, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 0.99)
DEFAULT_ASH_EPS = (0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
DEFAULT_ASH_PATIENCE = (1, 2)
AUTO_HIDDEN_QUANTILES = (0.05, 0.1, 0.25, 0.5, 0.75, 0.9)


def check_unit_thresholds(values, name: str, upper: float = 1.0) -> list[float]:
    values = [float(v) for v in values]
    require(len(values) >= 1, name, values, "a non-empty list of thresholds")
    for v in values:
        require(0.0 <= v <= upper, name, v, f"a threshold in [0, {upper:g}]")
    return values


def _first_true(hit: torch.Tensor) -> torch.Tensor:
    """hit [T, N] bool -> first t (1-based) with hit, T where none."""
    hit = hit.clone()
    hit[-1] = True
    return hit.float().argmax(0) + 1


def static_exit(n_tokens: int, t: int) -> torch.Tensor:
    require(int(t) >= 1, "static exit loop", t, "an integer >= 1")
    return torch.full((n_tokens,), int(t), dtype=torch.long)


def q_reached(log_survival: torch.Tensor, q: float) -> torch.Tensor:
    """CDF(t) >= q, evaluated as S_t <= 1 - q in log space: exact at q = 1 even when 1 - S_t rounds to 1."""
    return log_survival <= math.log1p(-q) if q < 1.0 else log_survival == -math.inf


def q_exit(gate_logits: torch.Tensor, q: float) -> torch.Tensor:
    """Q-exit loop per token (ouro §3.2); like objectives.q_exit_steps, but q = 1 always runs to the last loop
    unless the survival is exactly 0 (saturated gates make 1 - S_t round to 1 in fp32)."""
    check_unit_thresholds([q], "q_thresholds")
    log_survival = torch.cumsum(F.logsigmoid(-gate_logits.float()), dim=0)
    return _first_true(q_reached(log_survival, q))


def below_for(signal: torch.Tensor, eps: float, patience: int = 1) -> torch.Tensor:
    """First t at which signal < eps has held for `patience` consecutive loops ending at t (else T)."""
    require(int(patience) >= 1, "ash_patience", patience, "an integer >= 1")
    run = torch.zeros_like(signal[0], dtype=torch.long)
    hits = []
    for t in range(signal.shape[0]):
        run = torch.where(signal[t] < eps, run + 1, torch.zeros_like(run))
        hits.append(run >= patience)
    return _first_true(torch.stack(hits))


def hidden_diff_exit(hidden_delta: torch.Tensor, eps: float) -> torch.Tensor:
    require(eps >= 0, "hidden_eps", eps, "a threshold >= 0")
    return below_for(hidden_delta, eps, 1)


def ash_exit(ash_delta: torch.Tensor, eps: float, patience: int = 1) -> torch.Tensor:
    check_unit_thresholds([eps], "ash_eps", upper=2.0)
    return below_for(ash_delta, eps, patience)


def margin_exit(margin: torch.Tensor, tau: float) -> torch.Tensor:
    check_unit_thresholds([tau], "margin_thresholds")
    return _first_true(margin >= tau)


def pareto_front(points: list[dict], metric: str, higher_is_better: bool) -> list[int]:
    """Indices of the points not dominated in (avg_loops lower, metric better), by increasing avg_loops."""
    order = sorted(
        range(len(points)),
        key=lambda i: (points[i]["avg_loops"], -points[i][metric] if higher_is_better else points[i][metric]),
    )
    front, best = [], None
    for i in order:
        v = points[i][metric]
        if best is None or (v > best if higher_is_better else v < best):
            front.append(i)
            best = v
    return front


def auto_hidden_eps(hidden_delta: torch.Tensor) -> list[float]:
    finite = hidden_delta[1:].flatten()
    finite = finite[torch.isfinite(finite)]
    if finite.numel() == 0:
        return [0.0]
    qs = torch.quantile(finite.float()[:1_000_000], torch.tensor(AUTO_HIDDEN_QUANTILES))
    return sorted({round(float(v), 6) for v in qs})


def exit_frontier_from_stats(
    stats: LoopStats,
    exit_loops: int,
    *,
    q_thresholds=DEFAULT_Q,
    margin_thresholds=DEFAULT_MARGIN,
    hidden_eps=None,
    ash_eps=DEFAULT_ASH_EPS,
    ash_patience=DEFAULT_ASH_PATIENCE,
) -> dict:
    """All strategies' operating points over loops 1..exit_loops, and the Pareto frontiers."""
    require(
        1 <= int(exit_loops) <= stats.n_loops,
        "exit_loops",
        exit_loops,
        f"an integer in [1, {stats.n_loops}] (the loops collected)",
    )
    q_thresholds = check_unit_thresholds(q_thresholds, "q_thresholds")
    margin_thresholds = check_unit_thresholds(margin_thresholds, "margin_thresholds")
    ash_eps = check_unit_thresholds(ash_eps, "ash_eps", upper=2.0)
    for m in ash_patience:
        require(int(m) >= 1, "ash_patience", m, "integers >= 1")
    t_max = int(exit_loops)
    gates, hd = stats.gate_logits[:t_max], stats.hidden_delta[:t_max]
    margin, ash = stats.margin[:t_max], stats.ash_delta[:t_max]
    hidden_eps = auto_hidden_eps(hd) if hidden_eps is None else [float(e) for e in hidden_eps]
    for e in hidden_eps:
        require(e >= 0, "hidden_eps", e, "thresholds >= 0")

    points = []

    def add(strategy: str, param: dict, exit_loop: torch.Tensor):
        points.append(
            {
                "strategy": strategy,
                "param": param,
                **stats.quality(exit_loop),
                "exit_histogram": torch.bincount(exit_loop - 1, minlength=t_max).tolist(),
            }
        )

    for t in range(1, t_max + 1):
        add("static", {"t": t}, static_exit(stats.n_tokens, t))
    for q in q_thresholds:
        add("q_exit", {"q": q}, q_exit(gates, q))
    for e in hidden_eps:
        add("hidden_diff", {"eps": e}, hidden_diff_exit(hd, e))
    for tau in margin_thresholds:
        add("logit_margin", {"tau": tau}, margin_exit(margin, tau))
    for m in ash_patience:
        for e in ash_eps:
            add("ash", {"eps": e, "m": int(m)}, ash_exit(ash, e, int(m)))
    return {
        "exit_loops": t_max,
        "points": points,
        "pareto": {
            "loss": pareto_front(points, "loss", higher_is_better=False),
            "token_accuracy": pareto_front(points, "token_accuracy", higher_is_better=True),
        },
    }
