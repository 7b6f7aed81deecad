"""Validation of a warmup-stable-decay LR schedule, shared by the training config and the scheduler builder.

Kept free of torch/torchtitan imports so that checking a config stays cheap (titanloop.train.config runs it
before any process group or heavy import).
"""

from __future__ import annotations

from titanloop.config_errors import require, require_choice


def check_schedule(warmup_steps: int, decay_ratio: float | None, decay_type: str, min_lr_factor: float) -> None:
    """One-line ConfigError for an impossible warmup-stable-decay schedule (used by the config and the builder)."""
    require(warmup_steps >= 0, "lr_scheduler.warmup_steps", warmup_steps, "an integer >= 0")
    require(
        decay_ratio is None or 0 <= decay_ratio <= 1,
        "lr_scheduler.decay_ratio",
        decay_ratio,
        "a value in [0, 1] or absent",
    )
    require_choice(decay_type, "lr_scheduler.decay_type", ("linear", "sqrt", "cosine"))
    require(0 <= min_lr_factor <= 1, "lr_scheduler.min_lr_factor", min_lr_factor, "a value in [0, 1]")
