"""Testing aid, kept off the production step: an engine wrapper that makes chosen steps non-finite.

`training.inject_nan_steps` (the last rank's loss is NaN at these steps) and `training.inject_nan_grad_steps` (a
NaN gradient on the last rank) let the end-to-end tests drive the non-finite-step handling (skip, stop,
`<run_dir>/nonfinite/`) through the real trainer. Startup wraps the engine in `FaultInjectingEngine` only when one
of them is set; otherwise the trainer's step never sees this module.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn


class FaultInjectingEngine:
    """Delegates everything to `inner`; at the configured steps, on the last rank, multiplies the loss of each
    micro-batch by NaN (forward) or one local gradient by NaN (after backward)."""

    def __init__(self, inner, training, state, mesh):
        self.inner, self.state = inner, state
        self.loss_steps, self.grad_steps = set(training.inject_nan_steps), set(training.inject_nan_grad_steps)
        self.last_rank = mesh.rank == mesh.world_size - 1

    def __getattr__(self, name: str) -> Any:  # model, step, lr, checkpoint_states, nonfinite_grads, ...
        return getattr(self.inner, name)

    def forward(self, fn: Callable[[nn.Module], Any]) -> Any:
        loss, stats = self.inner.forward(fn)
        if self.last_rank and self.state.step in self.loss_steps:
            loss = loss * float("nan")
        return loss, stats

    def backward(self, loss: torch.Tensor, last_micro_batch: bool) -> None:
        self.inner.backward(loss, last_micro_batch)
        if self.last_rank and self.state.step in self.grad_steps:
            next(p for p in self.inner.model.parameters() if p.grad is not None).grad.mul_(float("nan"))


def with_fault_injection(engine, training, state, mesh):
    """`engine` itself unless the config asks for injected non-finite steps."""
    if training.inject_nan_steps or training.inject_nan_grad_steps:
        return FaultInjectingEngine(engine, training, state, mesh)
    return engine
