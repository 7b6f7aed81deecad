"""The callbacks a training run gets, in the order they run (titanloop.train.callbacks describes the hooks):
profiling (when enabled), garbage collection, held-out validation (when enabled), metrics, checkpointing,
preemption, non-finite losses and gradient norms. Its own module because validation and profiling build on
titanloop.train.callbacks."""

from __future__ import annotations

from titanloop.train.callbacks import Callback, Checkpointing, GarbageCollector, Metrics, NonFinite, Preemption
from titanloop.train.profiling import Profiling
from titanloop.train.validation import Validation


def default_callbacks(run) -> list[Callback]:
    callbacks = []
    if run.cfg.profiling.enable:
        callbacks.append(Profiling(run))  # first: its window starts before the other callbacks' pre_step
    callbacks.append(GarbageCollector())
    if run.cfg.validation.enable:
        callbacks.append(Validation(run))  # before Metrics, which logs its numbers
    return callbacks + [
        Metrics(run),
        Checkpointing(),
        Preemption(run),
        NonFinite(run.cfg.training.max_nan_steps, run.cfg.training.on_nonfinite),
    ]
