"""The DeepSpeed engine: ZeRO stage 2 or 3 (optional CPU offload) under the same trainer as FSDP2.

`parallelism.engine = "deepspeed"` swaps how parameters, gradients and optimizer state are sharded; the
trainer, objectives, loop sampler, data loader, LR/stage schedules, metrics and checkpoints stay the same.

    engine = DeepSpeedEngine(model, optimizer, zero_stage=3, ...)  # after torch.distributed is initialized
    engine.lr_schedulers = StagedLRSchedulers...([engine.optimizer])   # titanloop's schedule on the client AdamW
    loss, stats = engine.forward(fn, *args)           # fn(model, *args): forward + objective of one micro-batch
    engine.backward(loss * scale, last_micro_batch=i == accum - 1)
    grad_norm = engine.step(max_norm)                 # clip + optimizer step + LR step
    engine.checkpoint_states()                        # {"model", "optimizer", "lr_scheduler"} for titanloop.checkpoint

How titanloop drives `deepspeed.initialize` (DeepSpeed 0.19.8, launched by torchrun, never the deepspeed
launcher; the process group already exists):
- the client optimizer is the same torch AdamW as the FSDP2 path (ZeRO replaces its param groups by the flat
  fp32 partitions of this rank); titanloop's StagedLRSchedulers drives its `lr` directly, so DeepSpeed gets
  no scheduler and the LR curve and its checkpointed state are the FSDP path's;
- `managed_gradient_accumulation = false`: the caller owns the accumulation boundary, so the per-step
  micro-batch count can follow the batch ramp; the trainer scales the loss by 1/accum itself;
- clipping is ZeRO's (`clip_grad`, set per step from max_norm), on the global norm over all partitions;
- fp32 on CPU; on CUDA bf16 parameters with fp32 gradient accumulation (like FSDP2's mixed precision);
- ZeRO-3: the objective reads `model.lm_head.weight` outside the model's forward (chunked cross-entropy
  over the readouts), so the trainer's forward + objective run inside the forward of a thin root module
  (`_Step`) that registers the LM head as its external parameter: ZeRO-3 gathers it for that call and its
  backward and re-partitions it afterwards.

Checkpoints (`checkpoint_states`) hold the same keys and full tensors as the FSDP2 path: the model by FQN
(fp32 master weights) and the optimizer in torchtitan's flat FQN format (`state.<fqn>.exp_avg`, ...,
`param_groups.<fqn>.lr`, ...). A run therefore resumes on either engine from either engine's checkpoint;
see docs/engines.md. The price: a save or load materializes each full fp32 tensor on every rank in turn
(all of them at once, as the checkpointer writes one DCP plan).
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
import torch.nn as nn

from titanloop.config_errors import ConfigError
from titanloop.parallel.activation_checkpoint import apply_activation_checkpointing
from titanloop.train.engines.base import build_lr_schedulers, init_weights
from titanloop.train.engines.config import EngineSettings, check_zero_settings


class _Step(nn.Module):
    """Root module DeepSpeed wraps: runs one micro-batch's forward and objective, fn(model, *args)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, fn: Callable, *args):
        return fn(self.model, *args)


def deepspeed_config(
    *, zero_stage: int, offload: str, micro_batch_size: int, world_size: int, max_norm: float, bf16: bool
) -> dict:
    """The DeepSpeed JSON config of a titanloop run (titanloop owns batching, accumulation and the LR)."""
    check_zero_settings(zero_stage, offload)
    zero: dict = {"stage": zero_stage}
    if offload != "none":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if offload == "optimizer+params":
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    cfg = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": 1,  # bookkeeping only: the boundary is ours (managed_... = false)
        "train_batch_size": micro_batch_size * world_size,
        "managed_gradient_accumulation": False,
        "gradient_clipping": max_norm,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,  # the same torch AdamW as the FSDP path, also when offloaded
        "steps_per_print": 2**62,
        "wall_clock_breakdown": False,
    }
    if bf16:
        cfg["bf16"] = {"enabled": True}
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    return cfg


class DeepSpeedEngine:
    """One LoopLM under deepspeed.initialize; the engine interface the trainer uses (module docstring)."""

    name = "deepspeed"

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        zero_stage: int,
        offload: str,
        micro_batch_size: int,
        max_norm: float,
        bf16: bool = False,
    ):
        import deepspeed
        import torch.distributed as dist

        from deepspeed.utils import logger as ds_logger

        ds_logger.setLevel(logging.WARNING)
        self.zero_stage = zero_stage
        config = deepspeed_config(
            zero_stage=zero_stage,
            offload=offload,
            micro_batch_size=micro_batch_size,
            world_size=dist.get_world_size(),
            max_norm=max_norm,
            bf16=bf16,
        )
        self.wrapper = _Step(model)
        self.ds, self.zero_optimizer, _, _ = deepspeed.initialize(
            model=self.wrapper, optimizer=optimizer, config=config, dist_init_required=False
        )
        self.model = model
        self.optimizer = optimizer  # the client torch optimizer: the LR schedule writes its param groups
        if zero_stage == 3:
            deepspeed.zero.register_external_parameter(self.wrapper, model.lm_head.weight)
        self.lr_schedulers = None  # StagedLRSchedulers over [self.optimizer], set by the builder
        self.nonfinite_grads: list[str] = []  # (the loop's per-gradient report: not available under ZeRO)
        self._pending_grads = False

    # ----- one optimizer step ---------------------------------------------------------------------
    def forward(self, fn: Callable, *args):
        """fn(model, *args) inside the engine's forward (ZeRO-3 gathers what fn reads; see the docstring)."""
        return self.ds(fn, *args)

    def backward(self, loss: torch.Tensor, last_micro_batch: bool) -> None:
        """Backward of one micro-batch (already scaled by the caller); ZeRO reduces into the partitions."""
        del last_micro_batch  # the boundary is step(): ZeRO-2/3 reduce every micro-batch either way
        self.ds.backward(loss, scale_wrt_gas=False)
        self._pending_grads = True

    def step(self, max_norm: float) -> torch.Tensor:
        """Clip to max_norm (inf = no clipping), optimizer step, zero the gradients; returns the grad norm."""
        self.zero_optimizer.clip_grad = 0.0 if max_norm == float("inf") else float(max_norm)
        self.ds.step()
        self._pending_grads = False
        norm = self.ds.get_global_grad_norm()
        norm = torch.as_tensor(float(norm) if norm is not None else float("nan"))
        # ZeRO-2 skips the update itself on a non-finite norm (its overflow path); then the LR does not move
        # either, as on the FSDP path. Which gradients went bad is not tracked per parameter under ZeRO.
        if torch.isfinite(norm) or self.zero_stage == 3:
            self.lr_schedulers.step()
        return norm

    def lr(self) -> float:
        """The learning rate the coming optimizer step uses."""
        return self.lr_schedulers.schedulers[0].get_last_lr()[0]

    def zero_grad(self) -> None:
        """Drop this step's gradients, including those ZeRO already reduced into the partitions (a step skipped
        for a non-finite loss). ZeRO-2 takes its own overflow path: the gradients of a non-finite loss are
        non-finite, so its step() applies no update and clears every buffer (also the CPU-offload ones).
        ZeRO-3 checks overflow in fp16 only: its overflow clean-up is called directly."""
        opt = self.zero_optimizer
        if not self._pending_grads:
            opt.zero_grad(set_to_none=True)
            return
        self._pending_grads = False
        if self.zero_stage == 2:
            self.ds.step()
            if self.ds.was_step_applied():
                raise RuntimeError(
                    "ZeRO-2 applied a step whose loss was non-finite (its gradients were finite): "
                    "stop and resume from the last checkpoint"
                )
            return
        opt._overflow_clean_up(opt.loss_scale)
        self.ds._unmanaged_backward_count = 0

    # ----- checkpoints ----------------------------------------------------------------------------
    def checkpoint_states(self) -> dict:
        return {
            "model": DeepSpeedModelState(self),
            "optimizer": DeepSpeedOptimizerState(self),
            "lr_scheduler": self.lr_schedulers,
        }

    def optimizer_state(self) -> "DeepSpeedOptimizerState":
        return DeepSpeedOptimizerState(self)

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The LoopLM's parameters by FQN (tied ones once, under their first name)."""
        return list(self.model.named_parameters())

    def _flat_partitions(self) -> list[torch.Tensor]:
        """This rank's fp32 partitions, the tensors the client optimizer actually steps."""
        opt = self.zero_optimizer
        return list(opt.fp32_partitioned_groups_flat if self.zero_stage == 3 else opt.single_partition_of_fp32_groups)

    def materialize_optimizer_state(self) -> None:
        """Create AdamW's lazy state (zero moments) on the partitions without changing them (lr = 0 step), as
        torchtitan's init_optim_state does for the FSDP path; a no-op once a step has run."""
        inner, flats = self.optimizer, self._flat_partitions()
        if all(f in inner.state for f in flats):
            return
        groups, grads = inner.param_groups, [f.grad for f in flats]  # (offload keeps persistent grad buffers)
        inner.param_groups = [{**groups[0], "params": flats, "lr": 0.0}]
        try:
            for f in flats:
                f.grad = torch.zeros_like(f)
            inner.step()
        finally:
            inner.param_groups = groups
            for f, g in zip(flats, grads):
                f.grad = g
        if self.zero_stage == 2:
            self.zero_optimizer._lazy_init_hp_params_optimizer_state()


def _set_full_fp32(engine: "DeepSpeedEngine", param: nn.Parameter, value: torch.Tensor, key: str | None = None):
    """Write this rank's slice of a full fp32 value into the parameter's master copy (key None) or into its
    optimizer state `key`. ZeRO-3 goes through the partition directly: DeepSpeed 0.19.8's set_full_hp_param
    slices past the end of a padded last partition (parameters with fewer elements than ranks)."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    value = value.detach().to(torch.float32)
    if engine.zero_stage != 3:
        if key is None:
            safe_set_full_fp32_param(param, value)
        else:
            safe_set_full_optimizer_state(param, value, key)
        return
    opt = engine.zero_optimizer
    part, _ = opt._get_fp32_opt_state_partition(param, release_swap_buffers=False, optim_state_key=key)
    n, rank = part.numel(), opt._get_param_partition_rank(param)
    chunk = value.flatten()[n * rank : n * (rank + 1)]
    part.data.zero_()
    part.data[: chunk.numel()].copy_(chunk.to(part.device))


def _full_fp32(param: nn.Parameter, key: str | None = None) -> torch.Tensor | None:
    """The full fp32 value of a parameter (key None) or of its optimizer state `key` (collective)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    value = safe_get_full_fp32_param(param) if key is None else safe_get_full_optimizer_state(param, key)
    return None if value is None else value.detach().to("cpu", torch.float32).clone()


class DeepSpeedModelState:
    """The model as the checkpointer sees it: {fqn: full fp32 tensor}, the FSDP path's keys."""

    def __init__(self, engine: DeepSpeedEngine):
        self.engine = engine

    def _names(self) -> dict[str, nn.Parameter | torch.Tensor]:
        return dict(self.engine.model.state_dict(keep_vars=True))

    def state_dict(self) -> dict[str, torch.Tensor]:
        import deepspeed

        out, by_id = {}, {}
        for name, t in self._names().items():
            if id(t) not in by_id:
                value = _full_fp32(t) if isinstance(t, nn.Parameter) and t.requires_grad else None
                if value is None:  # frozen parameter or buffer: its (gathered) model value
                    with deepspeed.zero.GatheredParameters([t] if isinstance(t, nn.Parameter) else []):
                        value = t.detach().to("cpu").clone()
                by_id[id(t)] = value
            out[name] = by_id[id(t)]
        return out

    def load_state_dict(self, sd: dict) -> None:
        import deepspeed

        names = self._names()
        missing = sorted(set(names) - set(sd))
        if missing:
            raise ConfigError(
                f"checkpoint model state lacks {missing[0]!r} ({len(missing)} missing): it holds another model"
            )
        params = [t for t in names.values() if isinstance(t, nn.Parameter)]
        with torch.no_grad(), deepspeed.zero.GatheredParameters(params, modifier_rank=0):
            for name, t in names.items():
                t.data.copy_(sd[name].to(t.device, t.dtype).view_as(t.data))
        self.engine.zero_optimizer.refresh_fp32_params()  # the fp32 partitions from the (just set) weights
        for name, p in self.engine.named_parameters():
            if p.requires_grad:  # exact fp32 masters also when the model runs in bf16
                _set_full_fp32(self.engine, p, sd[name])


class DeepSpeedOptimizerState:
    """The optimizer in torchtitan's flat FQN format: state.<fqn>.<key> and param_groups.<fqn>.<key>."""

    def __init__(self, engine: DeepSpeedEngine):
        self.engine = engine

    def _trainable(self):
        return [(n, p) for n, p in self.engine.named_parameters() if p.requires_grad]

    def state_dict(self) -> dict:
        e = self.engine
        e.materialize_optimizer_state()
        group = {k: v for k, v in e.optimizer.param_groups[0].items() if k not in ("params", "param_names")}
        step = e.optimizer.state[e._flat_partitions()[0]]["step"]
        out = {}
        for name, p in self._trainable():
            out[f"state.{name}.step"] = step.detach().clone()
            for key in ("exp_avg", "exp_avg_sq"):
                out[f"state.{name}.{key}"] = _full_fp32(p, key)
        for name, _ in self._trainable():
            for k, v in group.items():
                out[f"param_groups.{name}.{k}"] = v
        return out

    def load_state_dict(self, sd: dict) -> None:
        e = self.engine
        e.materialize_optimizer_state()
        trainable = self._trainable()
        for name, p in trainable:
            for key in ("exp_avg", "exp_avg_sq"):
                if f"state.{name}.{key}" not in sd:
                    raise ConfigError(
                        f"checkpoint optimizer state lacks {f'state.{name}.{key}'!r}: it was saved "
                        "by another optimizer or model"
                    )
                _set_full_fp32(e, p, sd[f"state.{name}.{key}"], key)
        first = trainable[0][0]
        step = sd[f"state.{first}.step"]
        for f in e._flat_partitions():
            e.optimizer.state[f]["step"].copy_(step)
        for group in e.optimizer.param_groups:
            for k in list(group):
                if k not in ("params", "param_names") and f"param_groups.{first}.{k}" in sd:
                    v = sd[f"param_groups.{first}.{k}"]
                    group[k] = tuple(v) if isinstance(group[k], tuple) else v


def build_deepspeed_engine(
    e: EngineSettings,
    model: nn.Module,
    device,
    param_dtype: torch.dtype,
    load_weights: Callable[[nn.Module], None] | None = None,
) -> "DeepSpeedEngine":
    """The DeepSpeed counterpart of titanloop.train.engines.fsdp2.build_fsdp2_engine: activation checkpointing,
    the full model from the seed (then `load_weights`, e.g. a previous stage's), the same AdamW and LR schedule as
    FSDP2, deepspeed.initialize."""
    p = e.parallelism
    apply_activation_checkpointing(model, p.activation_checkpoint, p.ac_kept_loops)
    init_weights(model, device, load_weights)  # the full (unsharded) model from the seed, as FSDP2's shards
    model.train()
    optimizer = getattr(torch.optim, e.optimizer.name)(model.parameters(), **e.optimizer.kwargs(), foreach=True)
    engine = DeepSpeedEngine(
        model,
        optimizer,
        zero_stage=p.zero_stage,
        offload=p.zero_offload,
        micro_batch_size=e.micro_batch_size,
        max_norm=e.max_norm,
        bf16=param_dtype == torch.bfloat16,
    )
    engine.lr_schedulers = build_lr_schedulers(e.lr_scheduler, e.steps, [optimizer])
    return engine
