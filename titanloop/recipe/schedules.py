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

Batch: the stage-1 ramp (4M -> 8M tokens per step) is a global batch schedule realised through gradient
accumulation, so the per-device micro-batch stays fixed (`BatchRamp`; the loader follows the same schedule).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer

from titanloop.config_errors import ConfigError, require
from titanloop.recipe.schedule_checks import check_schedule

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
            return {
                "total_steps": int(total),
                "warmup_steps": int(self.warmup_steps),
                "decay_ratio": self.decay_ratio,
                "decay_type": self.decay_type,
                "min_lr_factor": float(self.min_lr_factor),
            }

        def build(self, *, optimizers, training_steps):
            check_schedule(self.warmup_steps, self.decay_ratio, self.decay_type, self.min_lr_factor)
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
            diff = ", ".join(
                f"{k}: {saved.get(k)!r} -> {self.shape.get(k)!r}"
                for k in sorted(set(saved) | set(self.shape))
                if saved.get(k) != self.shape.get(k)
            )
            if not self.allow_change:
                raise ConfigError(
                    f"lr_scheduler changed since the checkpoint ({diff}): restore the original values, or set "
                    "lr_scheduler.allow_schedule_change=true to continue from the saved step on the new schedule"
                )
            logger.warning("lr schedule changed on resume (%s); continuing on the new schedule", diff)
        super().load_state_dict({"last_epoch": state_dict["last_epoch"]})
        # torchtitan recomputes the scheduler's lr but leaves the optimizer's param groups alone (they are right
        # only if the optimizer state was restored too); set them so a reset optimizer resumes on schedule.
        self.apply_lr()

    def apply_lr(self) -> None:
        """Put the schedule's current LR on every optimizer param group (after loading optimizer or schedule
        state that carries another LR)."""
        for sched in self.schedulers:
            for group, lr in zip(sched.optimizer.param_groups, sched.get_last_lr()):
                group["lr"] = lr


def lr_factor(
    step: int, *, warmup_steps: int, total_steps: int, decay_ratio: float | None, decay_type: str, min_lr_factor: float
) -> float:
    """The multiplicative LR factor at `step` (0-based), using torchtitan's WSD lambda (for tests and plots)."""
    cfg = StagedLRSchedulers.Config(
        warmup_steps=warmup_steps,
        total_steps=total_steps,
        decay_ratio=decay_ratio,
        decay_type=decay_type,
        min_lr_factor=min_lr_factor,
    )
    import torch

    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    sched = cfg.build(optimizers=[opt], training_steps=total_steps)
    return sched.schedulers[0].lr_lambdas[0](step)


@dataclass
class BatchRamp:
    """Global batch (sequences per optimizer step) ramped from `start` to `end` over `ramp_steps` steps in
    stairs of `increment` sequences, constant `end` afterwards (Ouro stage 1: 4M -> 8M tokens).

    The per-step batch depends only on the step, never on the world size, so the global sample sequence is
    the same on any number of ranks (resume at another world size stays exact); the trainer realises it as
    `batch_at(step) / (micro_batch_size * dp_world)` gradient-accumulation steps, which is why `increment`
    must be a multiple of micro_batch_size * dp_world.
    """

    start: int
    end: int
    ramp_steps: int
    increment: int

    def __post_init__(self):
        require(self.start >= 1, "training.batch_ramp_start", self.start, "a positive number of sequences")
        require(
            self.end >= self.start,
            "training.global_batch_size",
            self.end,
            f">= training.batch_ramp_start={self.start} (the ramp goes up)",
        )
        require(self.ramp_steps >= 1, "training.batch_ramp_steps", self.ramp_steps, "an integer >= 1")
        require(
            self.increment >= 1 and self.start % self.increment == 0 and self.end % self.increment == 0,
            "training.batch_ramp_increment",
            self.increment,
            f"a positive divisor of both batch_ramp_start={self.start} and global_batch_size={self.end}",
        )

    def batch_at(self, step: int) -> int:
        """Sequences in optimizer step `step` (0-based)."""
        if step >= self.ramp_steps:
            return self.end
        exact = self.start + (self.end - self.start) * step / self.ramp_steps
        return max(self.start, int(exact) // self.increment * self.increment)

    def check_layout(self, micro_batch_size: int, dp_world: int) -> None:
        """Every step's batch must split into whole micro-batches on every data-parallel rank."""
        per_round = micro_batch_size * dp_world
        if self.increment % per_round == 0:
            return
        both = math.gcd(self.start, self.end)
        fits = math.lcm(self.increment, per_round)
        if both % fits:
            fits = per_round
        hint = (
            f"e.g. batch_ramp_increment={fits}"
            if both % fits == 0
            else f"no increment fits batch_ramp_start={self.start} and global_batch_size={self.end}; make both "
            f"multiples of {per_round} or lower micro_batch_size"
        )
        raise ConfigError(
            f"training.batch_ramp_increment={self.increment} is invalid at micro_batch_size="
            f"{micro_batch_size} x {dp_world} data-parallel ranks: expected a multiple of {per_round} "
            f"dividing batch_ramp_start and global_batch_size ({hint})"
        )

    def tokens_at(self, step: int, seq_len: int) -> int:
        return self.batch_at(step) * seq_len
