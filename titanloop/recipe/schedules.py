"""Per-stage schedules of Ouro's recipe (RECIPE §4): learning rate and global batch size.

LR: torchtitan's warmup-stable-decay (linear warmup, flat, then linear / sqrt / cosine decay to a floor
`min_lr_factor * lr`) covers every Ouro stage:
    1a  warmup + constant          decay_ratio = 0
    1b  constant                   warmup_steps = 0, decay_ratio = 0
    2   cosine 3e-4 -> 3e-5        decay_ratio = 1, decay_type = cosine, min_lr_factor = 0.1
    3   constant 3e-5
    4   cosine 3e-5 -> 1e-5        decay_ratio = 1, decay_type = cosine, min_lr_factor = 1/3
torchtitan saves only the step counter, so a resumed stage whose total steps (or any other schedule field)
changed would silently follow another curve. `StagedLRSchedulers` also saves the schedule's shape and refuses
to resume into a different one with a one-line error, unless `allow_schedule_change` is set, in which case
the new shape takes over from the saved step (documented, logged).

Batch: the stage-1 ramp (4M -> 8M tokens per step) is a global tokens-per-step schedule realised through
gradient accumulation, so the per-device micro-batch stays fixed (`BatchRamp.grad_accum_at`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer

from titanloop.config_errors import ConfigError, require

logger = logging.getLogger(__name__)


class StagedLRSchedulers(LRSchedulersContainer):
    """torchtitan's LR container plus a saved schedule shape that is checked on resume."""

    @dataclass(kw_only=True, slots=True)
    class Config(LRSchedulersContainer.Config):
        allow_schedule_change: bool = False
        """Resume even if the schedule shape differs from the checkpoint's (the new shape applies from the
        saved step on). Off by default: a changed total_steps usually means a mistake."""

        def shape(self, training_steps: int) -> dict:
            total = self.total_steps if self.total_steps is not None else training_steps
            return {"total_steps": int(total), "warmup_steps": int(self.warmup_steps),
                    "decay_ratio": self.decay_ratio, "decay_type": self.decay_type,
                    "min_lr_factor": float(self.min_lr_factor)}

        def build(self, *, optimizers, training_steps):
            require(self.warmup_steps >= 0, "lr_scheduler.warmup_steps", self.warmup_steps, "an integer >= 0")
            require(self.decay_ratio is None or 0 <= self.decay_ratio <= 1, "lr_scheduler.decay_ratio",
                    self.decay_ratio, "null or a value in [0, 1]")
            require(0 <= self.min_lr_factor <= 1, "lr_scheduler.min_lr_factor", self.min_lr_factor,
                    "a value in [0, 1]")
            require(self.decay_type in ("linear", "sqrt", "cosine"), "lr_scheduler.decay_type", self.decay_type,
                    "one of 'linear', 'sqrt', 'cosine'")
            base = LRSchedulersContainer.Config.build(self, optimizers=optimizers, training_steps=training_steps)
            lam = base.schedulers[0].lr_lambdas[0]
            return StagedLRSchedulers(optimizers, lam, self.shape(training_steps), self.allow_schedule_change)

    def __init__(self, optimizers, lr_lambda, shape: dict | None = None, allow_change: bool = False):
        super().__init__(optimizers, lr_lambda)
        self.shape = shape or {}
        self.allow_change = allow_change

    def state_dict(self):
        return {"last_epoch": self.schedulers[0].last_epoch, "shape": dict(self.shape)}

    def load_state_dict(self, state_dict):
        saved = state_dict.get("shape")
        if saved and self.shape and saved != self.shape:
            diff = ", ".join(f"{k}: {saved.get(k)!r} -> {self.shape.get(k)!r}"
                             for k in sorted(set(saved) | set(self.shape)) if saved.get(k) != self.shape.get(k))
            if not self.allow_change:
                raise ConfigError(
                    f"lr_scheduler changed since the checkpoint ({diff}): restore the original values, or set "
                    "lr_scheduler.allow_schedule_change=true to continue from the saved step on the new schedule")
            logger.warning("lr schedule changed on resume (%s); continuing on the new schedule", diff)
        super().load_state_dict({"last_epoch": state_dict["last_epoch"]})
        # torchtitan recomputes the scheduler's lr but leaves the optimizer's param groups alone (they are right
        # only if the optimizer state was restored too); set them so a reset optimizer resumes on schedule.
        for sched in self.schedulers:
            for group, lr in zip(sched.optimizer.param_groups, sched._last_lr):
                group["lr"] = lr


def lr_factor(step: int, *, warmup_steps: int, total_steps: int, decay_ratio: float | None, decay_type: str,
              min_lr_factor: float) -> float:
    """The multiplicative LR factor at `step` (0-based), using torchtitan's WSD lambda (for tests and plots)."""
    cfg = StagedLRSchedulers.Config(warmup_steps=warmup_steps, total_steps=total_steps, decay_ratio=decay_ratio,
                                    decay_type=decay_type, min_lr_factor=min_lr_factor)
    import torch

    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    sched = cfg.build(optimizers=[opt], training_steps=total_steps)
    return sched.schedulers[0].lr_lambdas[0](step)


@dataclass
class BatchRamp:
    """Global tokens per optimizer step, ramped linearly from `start_tokens` to `end_tokens` over `ramp_steps`
    (constant `end_tokens` after; ramp_steps = 0 means constant). Realised as gradient-accumulation steps."""

    start_tokens: int
    end_tokens: int
    ramp_steps: int = 0

    def __post_init__(self):
        require(self.start_tokens > 0, "batch_ramp.start_tokens", self.start_tokens, "a positive token count")
        require(self.end_tokens > 0, "batch_ramp.end_tokens", self.end_tokens, "a positive token count")
        require(self.ramp_steps >= 0, "batch_ramp.ramp_steps", self.ramp_steps, "an integer >= 0")

    def tokens_at(self, step: int) -> int:
        if self.ramp_steps == 0 or step >= self.ramp_steps:
            return self.end_tokens
        frac = step / self.ramp_steps
        return int(self.start_tokens + frac * (self.end_tokens - self.start_tokens))

    def grad_accum_at(self, step: int, *, micro_batch_size: int, seq_len: int, dp_world: int) -> int:
        """Micro-batches per rank for `step`: tokens_at(step) rounded down to whole micro-batch rounds (>= 1)."""
        per_round = micro_batch_size * seq_len * dp_world
        for name, tokens in (("start_tokens", self.start_tokens), ("end_tokens", self.end_tokens)):
            if tokens % per_round:
                raise ConfigError(
                    f"batch_ramp.{name}={tokens} is not a multiple of micro_batch_size*seq_len*dp_world={per_round}")
        return max(1, self.tokens_at(step) // per_round)

