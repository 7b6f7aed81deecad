"""Looped-LM objectives (RECIPE §2-3). See losses.py for the equations; objective.py puts them together into the
per-step training objective (`loop_objective`) and its per-loop statistics."""

from titanloop.objectives.chunked_ce import (
    IGNORE_INDEX,
    dense_cross_entropy,
    fused_per_loop_cross_entropy,
    linear_cross_entropy,
    per_loop_cross_entropy,
)
from titanloop.objectives.exit_distribution import exit_cdf, exit_entropy, exit_log_probs, exit_probs, q_exit_steps
from titanloop.objectives.jsrr import jsrr_loss, jsrr_probes, jsrr_target, spectral_radius_estimate
from titanloop.objectives.loop_sampler import LoopSampler, LoopSamplerConfig
from titanloop.objectives.losses import (
    ObjectiveConfig,
    dense_supervision_loss,
    dense_weights,
    final_loop_loss,
    geometric_prior,
    masked_mean,
    scale_penalty,
    stage1_loss,
    stage2_gate_loss,
)
from titanloop.objectives.objective import loop_objective, loop_statistics

__all__ = [
    "IGNORE_INDEX",
    "dense_cross_entropy",
    "fused_per_loop_cross_entropy",
    "linear_cross_entropy",
    "per_loop_cross_entropy",
    "exit_cdf",
    "exit_entropy",
    "exit_log_probs",
    "exit_probs",
    "q_exit_steps",
    "jsrr_loss",
    "jsrr_probes",
    "jsrr_target",
    "spectral_radius_estimate",
    "LoopSampler",
    "LoopSamplerConfig",
    "ObjectiveConfig",
    "dense_supervision_loss",
    "dense_weights",
    "final_loop_loss",
    "geometric_prior",
    "masked_mean",
    "scale_penalty",
    "stage1_loss",
    "stage2_gate_loss",
    "loop_objective",
    "loop_statistics",
]
