"""The engine seam: what the training loop needs from whatever holds the model, its gradients and optimizer.

    engine.model                              the module to call (parallelized: FSDP2/TP/AC/compile here)
    engine.forward(fn) -> fn(engine.model)    one micro-batch's forward and objective, run where the engine
                                              needs it (ZeRO-3 gathers the LM head the objective reads)
    engine.zero_grad()                        drop gradients (start of a step, or a skipped step)
    engine.backward(loss, last_micro_batch)   backward of one micro-batch's loss, already divided by the number
                                              of micro-batches; gradients are synchronized over data-parallel
                                              ranks only after the last micro-batch of the step
    engine.step(max_norm) -> grad_norm        clip to max_norm (inf: measure only), optimizer step, LR step
                                              (neither when the norm is non-finite)
    engine.lr() -> float                      the learning rate the coming optimizer step uses
    engine.checkpoint_states() -> dict        name -> object with state_dict()/load_state_dict() (or a bare
                                              nn.Module) that titanloop.checkpoint saves and restores
    engine.optimizer_state()                  the optimizer in torchtitan's flat-FQN state-dict format (what a
                                              new stage loads the previous stage's moments into)
    engine.lr_schedulers                      titanloop's StagedLRSchedulers over the engine's optimizer

Two engines implement it: `FSDP2Engine` (titanloop.train.engines.fsdp2) and `DeepSpeedEngine`
(titanloop.train.engines.deepspeed, `parallelism.engine = "deepspeed"`, docs/engines.md). This module holds what
both build alike: weight initialization and the LR schedule (the AdamW hyper-parameters: OptimizerSection.kwargs).
`build_engine` (titanloop.train.engines) picks one; startup loads a previous stage into it once, whichever it is.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch
import torch.nn as nn
from torchtitan.components.optimizer import OptimizersContainer

from titanloop.model.init import materialize
from titanloop.recipe.schedules import StagedLRSchedulers
from titanloop.train.engines.config import LRSchedulerSection


class Engine(Protocol):
    model: nn.Module

    def forward(self, fn: Callable[[nn.Module], Any]) -> Any: ...

    def zero_grad(self) -> None: ...

    def backward(self, loss: torch.Tensor, last_micro_batch: bool) -> None: ...

    def step(self, max_norm: float) -> torch.Tensor: ...

    def lr(self) -> float: ...

    def checkpoint_states(self) -> dict[str, Any]: ...

    def optimizer_state(self) -> Any: ...


def init_weights(model: nn.Module, device, load_weights: Callable[[nn.Module], None] | None = None) -> None:
    """Allocate this rank's part of the parallelized meta model on `device` and initialize it from the seed
    (titanloop.model.init), then let `load_weights` (startup's previous-stage loader, if any) overwrite it."""
    if any(p.is_meta for p in model.parameters()):
        materialize(model, device)
    else:  # built with real weights (a retrofit of a pretrained checkpoint): keep them
        model.to(device)
    if load_weights is not None:
        load_weights(model)


def build_lr_schedulers(s: LRSchedulerSection, steps: int, optimizers: OptimizersContainer) -> StagedLRSchedulers:
    """titanloop's warmup-stable-decay schedule over `steps` optimizer steps (both engines)."""
    config = StagedLRSchedulers.Config(
        allow_schedule_change=s.allow_schedule_change,
        warmup_steps=s.warmup_steps,
        decay_ratio=s.decay_ratio,
        decay_type=s.decay_type,
        min_lr_factor=s.min_lr_factor,
    )
    return config.build(optimizers=optimizers, training_steps=steps)
