"""The FSDP2 engine: FSDP2 over the data-parallel mesh, tensor/sequence parallelism, activation checkpointing and
per-layer compile (titanloop.parallel, applied from outside the model), torchtitan's optimizer and LR-scheduler
containers. It implements the engine seam of titanloop.train.engines.base.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Any, Callable

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import is_fake
from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig

from titanloop.parallel import parallelize_looplm, reshard_looped_layers, set_gradient_sync
from titanloop.parallel.float8 import precompute_scales, uses_float8_all_gather
from titanloop.parallel.grad_norm import clip_grads_, nonfinite_grad_names, total_grad_norm
from titanloop.recipe.schedules import StagedLRSchedulers
from titanloop.train.engines.base import build_lr_schedulers, init_weights
from titanloop.train.engines.config import EngineSettings, OptimizerSection


def _no_part(name: str):
    return nullcontext()


class FSDP2Engine:
    def __init__(self, model: nn.Module, optimizers: OptimizersContainer, lr_schedulers: StagedLRSchedulers):
        self.model, self.optimizers, self.lr_schedulers = model, optimizers, lr_schedulers
        self.nonfinite_grads: list[str] = []  # after a step with a non-finite norm: which local gradients were
        self.float8_all_gather = uses_float8_all_gather(model)  # float8.recipe = "tensorwise"

    def forward(self, fn: Callable[[nn.Module], Any]) -> Any:
        return fn(self.model)

    def zero_grad(self) -> None:
        self.optimizers.zero_grad()

    def backward(self, loss: torch.Tensor, last_micro_batch: bool) -> None:
        set_gradient_sync(self.model, last_micro_batch)
        loss.backward()
        if last_micro_batch:
            reshard_looped_layers(self.model)  # the looped stack stayed unsharded through all T backward calls

    def grad_norm(self) -> torch.Tensor:
        """The gradient norm over all ranks, left on the device (the trainer reads it with the loss, one read)."""
        return total_grad_norm([p for p in self.model.parameters() if p.requires_grad])

    def step(
        self,
        max_norm: float,
        grad_norm: torch.Tensor | None = None,
        norm_value: float | None = None,
        part: Callable[[str], Any] | None = None,
    ) -> torch.Tensor:
        """Clip, optimizer and LR step unless the norm is non-finite. `grad_norm`/`norm_value`: the norm from
        `grad_norm()` and its value as already read on the host (else computed and read here). `part`: the
        whole-step profile's timer (titanloop.train.step_timer)."""
        part = part or _no_part
        params = [p for p in self.model.parameters() if p.requires_grad]
        if grad_norm is None:
            with part("grad_norm"):
                grad_norm = total_grad_norm(params)  # one norm per mesh group under TP, combined
        self.nonfinite_grads = []
        # The norm is reduced over all ranks: every rank takes the same branch (one device-to-host read per step).
        # On fake tensors (the dry run's memory plan) the value is unknown and the step is planned as a finite one.
        if norm_value is not None:
            finite = math.isfinite(norm_value)
        else:
            finite = is_fake(grad_norm) or bool(torch.isfinite(grad_norm))
        if finite:
            # min(1, max_norm / (norm + 1e-6)) is 1 when the norm is clearly below the bound: gradients * 1.0 are
            # the gradients, so that scaling is skipped (the margin covers float32 rounding of the quotient)
            if norm_value is None or not norm_value * (1 + 1e-5) + 1e-5 < max_norm:
                with part("clip"):
                    clip_grads_(params, max_norm, grad_norm)
            with part("optimizer"):
                self.optimizers.step()
            with part("lr"):
                self.lr_schedulers.step()
            if self.float8_all_gather:  # the next all-gathers' float8 scales, one all-reduce for all weights
                precompute_scales(self.model)
        else:  # which local gradients went bad
            self.nonfinite_grads = nonfinite_grad_names(self.model)
        return grad_norm

    def lr(self) -> float:
        return self.lr_schedulers.schedulers[0].get_last_lr()[0]

    def checkpoint_states(self) -> dict[str, Any]:
        return {"model": self.model, "optimizer": self.optimizers, "lr_scheduler": self.lr_schedulers}

    def optimizer_state(self) -> OptimizersContainer:
        return self.optimizers


def parallelize(
    e: EngineSettings, model: nn.Module, mesh, param_dtype: torch.dtype, device_type: str | None = None
) -> nn.Module:
    """float8 -> TP -> AC -> compile -> FSDP2 (titanloop.parallel), in train mode; a meta-device model stays on meta.
    device_type (default: the mesh's): float8 is emulated without a GPU; the dry run plans as on "cuda"."""
    p = e.parallelism
    model = parallelize_looplm(
        model,
        parallel_dims=mesh.dims,
        tp_mesh=mesh.tp_mesh,
        sequence_parallel=p.sequence_parallel,
        activation_checkpoint=p.activation_checkpoint,
        ac_kept_loops=p.ac_kept_loops,
        compile=p.compile,
        compile_backend=p.compile_backend,
        param_dtype=param_dtype,
        reduce_dtype=torch.float32,
        reshard_looped=p.reshard_looped,
        # JSRR's forward-mode AD runs per-document SDPA (math), outside the graph
        compile_fullgraph=False if e.forward_ad else None,
        float8=e.float8.recipe,
        float8_filter=e.float8.filter,
        float8_emulate=(device_type or mesh.device_type) != "cuda",
    )
    model.train()
    return model


def build_optimizer(o: OptimizerSection, model: nn.Module, tp: int, device_type: str = "cpu") -> OptimizersContainer:
    config = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name=o.name, optimizer_kwargs=o.kwargs())],
        implementation=o.resolved_implementation(device_type, tp),
    )
    return config.build(model_parts=[model])


def build_fsdp2_engine(
    e: EngineSettings,
    model: nn.Module,
    mesh,
    param_dtype: torch.dtype,
    load_weights: Callable[[nn.Module], None] | None = None,
) -> FSDP2Engine:
    """Parallelize the (meta) model, materialize its shards (then `load_weights`, e.g. a previous stage's), build
    its optimizer and LR schedule."""
    model = parallelize(e, model, mesh, param_dtype)
    init_weights(model, mesh.device, load_weights)
    optimizers = build_optimizer(e.optimizer, model, mesh.dims.tp, mesh.device_type)
    lr_schedulers = build_lr_schedulers(e.lr_scheduler, e.steps, optimizers)
    return FSDP2Engine(model, optimizers, lr_schedulers)
