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

`FSDP2Engine` is the implementation: FSDP2 over the data-parallel mesh, tensor/sequence parallelism,
activation checkpointing and per-layer compile (titanloop.parallel), torchtitan's optimizer and LR-scheduler
containers. Another engine (e.g. DeepSpeed) implements the same six members and is chosen in
`build_engine`; the loop (titanloop.train.loop) does not change. `DeepSpeedEngine`
(titanloop.train.engine_deepspeed, `parallelism.engine = "deepspeed"`, docs/engines.md) is the second one.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import is_fake
from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
from torchtitan.distributed import utils as dist_utils

from titanloop.model.init import materialize
from titanloop.parallel import parallelize_looplm, reshard_looped_layers, set_gradient_sync
from titanloop.parallel.float8 import precompute_scales, uses_float8_all_gather
from titanloop.parallel.grad_norm import clip_grad_norm_ as clip_grad_norm_mixed_meshes
from titanloop.recipe import stages
from titanloop.recipe.schedules import StagedLRSchedulers
from titanloop.train.config import TrainConfig


class Engine(Protocol):
    model: nn.Module

    def forward(self, fn: Callable[[nn.Module], Any]) -> Any: ...

    def zero_grad(self) -> None: ...

    def backward(self, loss: torch.Tensor, last_micro_batch: bool) -> None: ...

    def step(self, max_norm: float) -> torch.Tensor: ...

    def lr(self) -> float: ...

    def checkpoint_states(self) -> dict[str, Any]: ...


class FSDP2Engine:
    def __init__(self, model: nn.Module, optimizers: OptimizersContainer, lr_schedulers: StagedLRSchedulers,
                 mixed_meshes: bool):
        self.model, self.optimizers, self.lr_schedulers = model, optimizers, lr_schedulers
        self.mixed_meshes = mixed_meshes  # TP: parameters on two meshes, grad norm per mesh group
        self.nonfinite_grads: list[str] = []  # after a step with a non-finite norm: which local gradients were
        self.float8_all_gather = uses_float8_all_gather(model)  # training.float8 = "tensorwise"

    def forward(self, fn: Callable[[nn.Module], Any]) -> Any:
        return fn(self.model)

    def zero_grad(self) -> None:
        self.optimizers.zero_grad()

    def backward(self, loss: torch.Tensor, last_micro_batch: bool) -> None:
        set_gradient_sync(self.model, last_micro_batch)
        loss.backward()
        if last_micro_batch:
            reshard_looped_layers(self.model)  # the looped stack stayed unsharded through all T backward calls

    def step(self, max_norm: float) -> torch.Tensor:
        params = [p for p in self.model.parameters() if p.requires_grad]
        # Per-gradient norms of the local shards before clipping (one foreach kernel, no host sync): with a NaN/Inf
        # total norm, clipping spreads it to every gradient, so this is what says which gradient went bad.
        named = [(n, p.grad) for n, p in self.model.named_parameters() if p.requires_grad and p.grad is not None]
        local = [g.to_local() if hasattr(g, "to_local") else g for _, g in named]
        per_grad = torch._foreach_norm(local) if local else []
        if self.mixed_meshes:
            grad_norm = clip_grad_norm_mixed_meshes(params, max_norm)
        else:
            grad_norm = dist_utils.clip_grad_norm_(params, max_norm, foreach=True)
        self.nonfinite_grads = []
        # The norm is reduced over all ranks: every rank takes the same branch. On fake tensors (the dry run's
        # memory plan) the value is unknown and the step is planned as a finite one.
        if is_fake(grad_norm) or torch.isfinite(grad_norm):
            self.optimizers.step()
            self.lr_schedulers.step()
            if self.float8_all_gather:  # the next all-gathers' float8 scales, one all-reduce for all weights
                precompute_scales(self.model)
        elif per_grad:
            finite = torch.isfinite(torch.stack(per_grad)).tolist()
            self.nonfinite_grads = [name for (name, _), ok in zip(named, finite) if not ok]
        return grad_norm

    def lr(self) -> float:
        return self.lr_schedulers.schedulers[0].get_last_lr()[0]

    def checkpoint_states(self) -> dict[str, Any]:
        return {"model": self.model, "optimizer": self.optimizers, "lr_scheduler": self.lr_schedulers}


def parallelize(cfg: TrainConfig, model: nn.Module, mesh, param_dtype: torch.dtype,
                device_type: str | None = None) -> nn.Module:
    """float8 -> TP -> AC -> compile -> FSDP2 (titanloop.parallel), in train mode; a meta-device model stays on meta.
    device_type (default: the mesh's): float8 is emulated without a GPU; the dry run plans as on "cuda"."""
    p = cfg.parallelism
    model = parallelize_looplm(model, parallel_dims=mesh.dims, tp_mesh=mesh.tp_mesh,
                               sequence_parallel=p.sequence_parallel, activation_checkpoint=p.activation_checkpoint,
                               compile=p.compile, compile_backend=p.compile_backend, param_dtype=param_dtype,
                               reduce_dtype=torch.float32, reshard_looped=p.reshard_looped,
                               float8=cfg.training.float8, float8_emulate=(device_type or mesh.device_type) != "cuda")
    model.train()
    return model


def init_weights(cfg: TrainConfig, model: nn.Module, device, stage_init: bool) -> None:
    """Allocate this rank's shards of the parallelized meta model on `device` and initialize them from the
    seed (titanloop.model.init), or load the previous stage's full weights into them (titanloop.recipe.stages)."""
    if any(p.is_meta for p in model.parameters()):
        materialize(model, device)
    else:  # built with real weights (a retrofit of a pretrained checkpoint): keep them
        model.to(device)
    if stage_init:
        stages.load_stage_weights(model, cfg.stage, stages.previous_stage_state(cfg.stage, model))


def optimizer_kwargs(cfg: TrainConfig) -> dict:
    """The AdamW hyper-parameters (both engines)."""
    o = cfg.optimizer
    return {"lr": o.lr, "betas": tuple(o.betas), "weight_decay": o.weight_decay, "eps": o.eps}


def build_optimizer(cfg: TrainConfig, model: nn.Module, tp: int) -> OptimizersContainer:
    config = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name=cfg.optimizer.name,
                                       optimizer_kwargs=optimizer_kwargs(cfg))],
        # TP mixes DTensor and plain parameters, which the foreach/fused kernels cannot group.
        implementation="for-loop" if tp > 1 else "foreach")
    return config.build(model_parts=[model])


def build_lr_schedulers(cfg: TrainConfig, optimizers: OptimizersContainer) -> StagedLRSchedulers:
    s = cfg.lr_scheduler
    config = StagedLRSchedulers.Config(allow_schedule_change=s.allow_schedule_change, warmup_steps=s.warmup_steps,
                                       decay_ratio=s.decay_ratio, decay_type=s.decay_type,
                                       min_lr_factor=s.min_lr_factor)
    return config.build(optimizers=optimizers, training_steps=cfg.training.steps)


def build_engine(cfg: TrainConfig, model: nn.Module, mesh, param_dtype: torch.dtype, stage_init: bool) -> Engine:
    """Parallelize the (meta) model, materialize its shards, build its optimizer and LR schedule; a new stage
    may start from the previous stage's weights and optimizer state (titanloop.recipe.stages)."""
    if cfg.parallelism.engine == "deepspeed":
        from titanloop.train.engine_deepspeed import build_deepspeed_engine

        return build_deepspeed_engine(cfg, model, mesh.device, param_dtype, stage_init)
    model = parallelize(cfg, model, mesh, param_dtype)
    init_weights(cfg, model, mesh.device, stage_init)
    optimizers = build_optimizer(cfg, model, mesh.dims.tp)
    lr_schedulers = build_lr_schedulers(cfg, optimizers)
    if stage_init and stages.keeps_optimizer(cfg.stage, cfg.objective.name):
        stages.load_previous_stage_optimizer(cfg.stage, optimizers, lr_schedulers)
    return FSDP2Engine(model, optimizers, lr_schedulers, mixed_meshes=mesh.dims.tp > 1)
