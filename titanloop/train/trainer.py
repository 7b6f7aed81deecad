"""LoopTrainer: torchtitan's Trainer, extended for looped LMs.

What comes from torchtitan (0.3.0): the training loop (`Trainer.train`: checkpoint load, profiler,
GC control, step counter, periodic checkpoint save, PG timeouts), ParallelDims and its device meshes,
`init_distributed`, the optimizer and LR-scheduler containers, DCP checkpointing (CheckpointManager),
gradient clipping across DTensor meshes, and the ModelSpec protocol (titanloop.train.model_spec).

What LoopTrainer changes:
- `__init__` builds the same components as Trainer.__init__ but from the titanloop TOML config: the LoopLM
  is a plain nn.Module (not torchtitan's Module-protocol Decoder) and the data come from titanloop.data.
  The model is initialized in full on CPU from the seed, then parallelized, so every mesh layout starts
  from bit-identical weights.
- `train_step`: the loop count T of the step from the LoopSampler (a function of the step only, hence
  the same on every rank); gradient accumulation with FSDP gradient sync on the last micro-batch only;
  the per-loop objective (titanloop.train.objective); one all-reduce of [loss, per-loop stats] that also
  detects a non-finite loss on any rank, in which case every rank skips the step (grads dropped, no
  optimizer/LR step) and counts it; per-loop metrics to stdout and W&B.
- `should_continue_training` also stops after `training.max_nan_steps` non-finite steps in a row.
"""

from __future__ import annotations

from titanloop.train.cpu_shim import use_cpu_if_no_gpu

DEVICE_TYPE = use_cpu_if_no_gpu()  # must run before the torchtitan imports below

import math  # noqa: E402
import os  # noqa: E402
from pathlib import Path  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torchtitan.components.checkpoint import CheckpointManager  # noqa: E402
from torchtitan.components.optimizer import OptimizersContainer  # noqa: E402
from torchtitan.components.optimizer.optimizer import ParamGroupConfig  # noqa: E402
from torchtitan.config.configs import CommConfig, ParallelismConfig, TrainingConfig  # noqa: E402
from torchtitan.distributed import utils as dist_utils  # noqa: E402
from torchtitan.tools import utils as tt_utils  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402

from titanloop.data import DataConfig, build_dataloader  # noqa: E402
from titanloop.objectives import LoopSampler  # noqa: E402
from titanloop.recipe import stages  # noqa: E402
from titanloop.recipe.schedules import StagedLRSchedulers  # noqa: E402
from titanloop.parallel import (count_collectives, gather_sequence, reshard_looped_layers,  # noqa: E402
                                set_gradient_sync)
from titanloop.parallel.grad_norm import clip_grad_norm_ as clip_grad_norm_mixed_meshes  # noqa: E402
from titanloop.train.config import TrainConfig, mesh_degrees  # noqa: E402
from titanloop.train.metrics import H100_BF16_PEAK_FLOPS, MetricsLogger  # noqa: E402
from titanloop.train.model_spec import looplm_model_spec  # noqa: E402
from titanloop.train.objective import loop_objective  # noqa: E402

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def torchtitan_config(cfg: TrainConfig, world_size: int) -> Trainer.Config:
    """The torchtitan Trainer.Config equivalent of a titanloop config (what the inherited loop reads)."""
    dp, tp = mesh_degrees(cfg, world_size)
    t = cfg.training
    spec = looplm_model_spec(cfg.looplm, flavor=cfg.model.preset)
    titan = Trainer.Config(
        model_spec=spec,
        dump_folder=t.run_dir,
        training=TrainingConfig(local_batch_size=t.micro_batch_size, global_batch_size=t.global_batch_size,
                                seq_len=t.seq_len, max_norm=t.max_norm, steps=t.steps, disable_cuda_graphs=True),
        parallelism=ParallelismConfig(data_parallel_shard_degree=dp, tensor_parallel_degree=tp,
                                      enable_sequence_parallel=cfg.parallelism.sequence_parallel,
                                      spmd_backend="partial_dtensor"),
        optimizer=OptimizersContainer.Config(
            param_groups=[ParamGroupConfig(pattern=".*", optimizer_name=cfg.optimizer.name, optimizer_kwargs={
                "lr": cfg.optimizer.lr, "betas": tuple(cfg.optimizer.betas),
                "weight_decay": cfg.optimizer.weight_decay, "eps": cfg.optimizer.eps})],
            # TP mixes DTensor and plain parameters, which the foreach/fused kernels cannot group.
            implementation="for-loop" if tp > 1 else "foreach"),
        lr_scheduler=StagedLRSchedulers.Config(
            allow_schedule_change=cfg.lr_scheduler.allow_schedule_change,
            warmup_steps=cfg.lr_scheduler.warmup_steps, decay_ratio=cfg.lr_scheduler.decay_ratio,
            decay_type=cfg.lr_scheduler.decay_type, min_lr_factor=cfg.lr_scheduler.min_lr_factor),
        checkpoint=CheckpointManager.Config(enable=cfg.checkpoint.enable, folder="checkpoint",
                                            interval=cfg.checkpoint.interval,
                                            keep_latest_k=cfg.checkpoint.keep_latest_k,
                                            last_save_model_only=False),
        comm=CommConfig(init_timeout_seconds=300, train_timeout_seconds=300, trace_buf_size=0),
    )
    titan.model_spec.model.update_from_config(config=cfg)
    return titan


def build_checkpointer(trainer: "LoopTrainer"):
    """The checkpointer torchtitan's loop drives: titanloop.checkpoint's atomic, preemption-safe one.

    <run_dir>/checkpoints/step-N (DCP, reshardable) with model, optimizer, LR schedulers, the data loader's
    global state, the train state (step, tokens, skipped steps), per-rank RNG, the resolved config and the
    stage name; auto-resume from the run dir; SIGUSR1/SIGTERM -> save and exit 75 (docs/checkpointing.md).
    """
    from titanloop.checkpoint import CheckpointConfig, Checkpointer, PreemptionMonitor, TrainerCheckpointer

    c = trainer.loop_cfg.checkpoint
    cfg = CheckpointConfig(enable=c.enable, interval=c.interval, keep_last=c.keep_latest_k or 10**9,
                           keep_every=c.keep_every, mode=c.mode)
    states = {"model": trainer.model_parts[0], "optimizer": trainer.optimizers,
              "lr_scheduler": trainer.lr_schedulers, "dataloader": trainer.dataloader, "train_state": trainer}
    checkpointer = Checkpointer(cfg, trainer.loop_cfg.training.run_dir, states, config=trainer.loop_cfg.to_dict(),
                                stage=trainer.loop_cfg.stage.name or os.environ.get("TITANLOOP_STAGE"))
    monitor = PreemptionMonitor(c.preemption_signals, slurm_time_margin_s=c.slurm_time_margin_s)
    return TrainerCheckpointer(checkpointer, monitor)


class LoopTrainer(Trainer):
    def __init__(self, cfg: TrainConfig):  # noqa: D107 - see the module docstring
        self.loop_cfg = cfg
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.config = config = torchtitan_config(cfg, world_size)
        model_spec = config.model_spec
        self.device = tt_utils.get_local_device()
        tt_utils.device_module.set_device(self.device)
        self.parallel_dims = pdims = self.init_distributed()  # torchtitan: process group + ParallelDims
        pdims.build_mesh()
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.tp_mesh = pdims.get_optional_mesh("tp")
        self.sp_mesh = self.tp_mesh if cfg.parallelism.sequence_parallel else None
        batch_mesh = pdims.get_optional_mesh("batch")
        self.dp_rank, self.dp_world = (batch_mesh.get_local_rank(), batch_mesh.size()) if batch_mesh else (0, 1)
        self.gc_handler = tt_utils.GarbageCollection(gc_freq=50)

        # Model: full init on CPU from the seed (identical on every rank and layout), then TP/AC/compile/FSDP.
        torch.manual_seed(cfg.training.seed)
        model = model_spec.model.build()
        if cfg.objective.name == "stage2_gate":  # ouro §3.4: the LM is frozen, only the exit gate learns
            for name, p in model.named_parameters():
                p.requires_grad_(name.startswith("early_exit_gate."))
        # A new stage of a staged recipe starts from the previous stage's weights (titanloop.recipe.stages),
        # unless this run dir already has checkpoints of its own (then the usual auto-resume applies).
        self.stage_init = bool(cfg.stage.init_from) and not self._run_dir_has_checkpoint()
        if self.stage_init:
            stages.init_model_from_previous_stage(model, cfg.stage)
        self.model_config = model_spec.model
        self.n_params, _ = model_spec.model.get_nparams_and_flops(model, cfg.training.seq_len)
        param_dtype = self._param_dtype()
        model = model_spec.parallelize_fn(
            model, parallel_dims=pdims, tp_mesh=self.tp_mesh, sequence_parallel=cfg.parallelism.sequence_parallel,
            activation_checkpoint=cfg.parallelism.activation_checkpoint, compile=cfg.parallelism.compile,
            compile_backend=cfg.parallelism.compile_backend, param_dtype=param_dtype, reduce_dtype=torch.float32,
            reshard_looped=cfg.parallelism.reshard_looped)
        model.to(self.device)
        model.train()
        self.model_parts = [model]

        self.optimizers = config.optimizer.build(model_parts=self.model_parts)
        self.lr_schedulers = config.lr_scheduler.build(optimizers=self.optimizers, training_steps=cfg.training.steps)
        if self.stage_init and stages.keeps_optimizer(cfg.stage, cfg.objective.name):
            stages.load_previous_stage_optimizer(cfg.stage, self.optimizers, self.lr_schedulers)
        self.step, self.ntokens_seen = 0, 0
        self.nan_streak, self.skipped_steps = 0, 0
        self.loop_sampler = LoopSampler(cfg.loop_sampler)

        t = cfg.training
        ramp = t.batch_ramp()  # per-step global batch (stage-1 ramp) or None
        self.dataloader = build_dataloader(DataConfig.from_dict(cfg.data), seq_len=t.seq_len,
                                           micro_batch_size=t.micro_batch_size,
                                           global_batch_size=t.global_batch_size, dp_rank=self.dp_rank,
                                           dp_world=self.dp_world, vocab_size=cfg.looplm.vocab_size,
                                           batch_schedule=ramp.batch_at if ramp else None)
        # torchtitan's attribute; with a batch ramp it is the first step's value (each step asks the loader)
        self.gradient_accumulation_steps = self.dataloader.grad_accum_at(0)
        self.checkpointer = build_checkpointer(self)
        self.train_context = dist_utils.get_spmd_context(parallel_dims=pdims)
        self.metrics = MetricsLogger(cfg.metrics, t.run_dir, self.rank, cfg.to_dict())
        self.jsrr_generator = torch.Generator().manual_seed(t.seed + 1)
        if self.rank == 0:
            print(f"[titanloop] LoopLM {cfg.model.preset}: {self.n_params:,} parameters | world {self.world_size} "
                  f"= dp {self.dp_world} x tp {pdims.tp} | {param_dtype} params on {DEVICE_TYPE} | "
                  f"global batch {t.global_batch_size} x {t.seq_len} tokens, grad accum "
                  f"{self.gradient_accumulation_steps} | objective {cfg.objective.name} | loops "
                  f"{cfg.loop_sampler.kind}", flush=True)

    def _run_dir_has_checkpoint(self) -> bool:
        from titanloop.checkpoint import CheckpointConfig, layout

        root = Path(self.loop_cfg.training.run_dir) / CheckpointConfig.folder
        return self.loop_cfg.checkpoint.enable and layout.latest_step(root) is not None

    def _param_dtype(self) -> torch.dtype:
        dtype = self.loop_cfg.training.dtype
        if dtype == "auto":
            return torch.bfloat16 if DEVICE_TYPE == "cuda" else torch.float32
        return _DTYPES[dtype]

    # ----- data ---------------------------------------------------------------------------------
    def batch_generator(self, data_iterable):
        """Micro-batches (dicts of CPU tensors) from the titanloop loader; moved to the device per step."""
        for batch in data_iterable:
            yield batch

    # ----- one optimizer step --------------------------------------------------------------------
    def forward_backward_step(self, *, input_dict: dict, n_loops: int, loss_scale: float):
        """Forward T loops, the per-loop objective on the full sequence, backward. Returns (loss, stats)."""
        cfg = self.loop_cfg
        model = self.model_parts[0]
        input_ids = input_dict["input_ids"].to(self.device)
        labels = input_dict["labels"].to(self.device)
        doc_ids = input_dict["doc_ids"].to(self.device) if cfg.training.doc_masking else None
        self.ntokens_seen += labels.numel()
        with self.train_context():
            out = model(input_ids, n_loops, doc_ids=doc_ids)
            readouts = [gather_sequence(r, self.sp_mesh) for r in out.readouts]
            states = [gather_sequence(s, self.sp_mesh) for s in out.states]
            gates = gather_sequence(out.gate_logits, self.sp_mesh, seq_dim=2)
            jsrr_map = None
            if cfg.objective.jsrr_weight > 0:
                jsrr_map = self._recurrent_map(model, input_ids, doc_ids, n_loops)
            loss, stats = loop_objective(cfg.objective, readouts, states, gates, labels, model.lm_head.weight,
                                         jsrr_map, out.next_input, self.jsrr_generator)
            if self.step in cfg.training.inject_nan_steps and self.rank == self.world_size - 1:
                loss = loss * float("nan")  # testing aid: a non-finite loss on the last rank only
            (loss * loss_scale).backward()
        return loss.detach(), stats

    @staticmethod
    def _recurrent_map(model, input_ids, doc_ids, n_loops):
        """Φ at the last loop (the map JSRR linearizes, stars §5), closed over RoPE tables and the mask."""
        cos, sin, mask = model.rope_and_mask(input_ids, doc_ids=doc_ids)
        t = min(n_loops, model.cfg.max_loops - 1) if model.loop_norms is not None else n_loops
        return lambda x: model.recurrent_map(x, t, cos, sin, mask)

    def train_step(self, data_iterator):
        """One optimizer step (torchtitan's Trainer.train calls this once per step)."""
        if self.loop_cfg.metrics.count_comms:
            with count_collectives() as comms:
                logged = self._optimizer_step(data_iterator)
        else:
            comms, logged = None, self._optimizer_step(data_iterator)
        if logged is not None:
            scalars, per_loop = logged
            if comms is not None:
                scalars.update({f"comm/{kind}": n for kind, n in sorted(comms.items())})
            self.metrics.log(self.step, scalars, per_loop)

    def _optimizer_step(self, data_iterator) -> tuple[dict, dict] | None:
        """Forward/backward over the micro-batches, NaN check, clip, optimizer and LR step; returns the
        metrics to log (None when this step is not logged or was skipped)."""
        cfg = self.loop_cfg
        model = self.model_parts[0]
        start = time.perf_counter()
        n_loops = self.loop_sampler(self.step)
        self.optimizers.zero_grad()
        lr = self.lr_schedulers.schedulers[0].get_last_lr()[0]
        accum = self.dataloader.grad_accum_at(self.step - 1)  # self.step is 1-based inside train_step
        loss_sum, stats_sum = torch.zeros((), device=self.device), None
        for i in range(accum):
            set_gradient_sync(model, last_micro_batch=(i == accum - 1))
            loss, stats = self.forward_backward_step(input_dict=next(data_iterator), n_loops=n_loops,
                                                     loss_scale=1.0 / accum)
            loss_sum += loss / accum
            stats = {k: v / accum for k, v in stats.items()}
            stats_sum = stats if stats_sum is None else {k: stats_sum[k] + v for k, v in stats.items()}
        reshard_looped_layers(model)  # the looped stack stayed unsharded through all T backward calls

        # One all-reduce carries the loss and every statistic; tp replicas hold equal values, so the
        # world mean is the mean over data-parallel ranks. A NaN/Inf on any rank makes the sum non-finite.
        keys = sorted(stats_sum)
        packed = torch.cat([loss_sum.view(1)] + [stats_sum[k].reshape(-1).float() for k in keys]).to(self.device)
        dist.all_reduce(packed)
        packed = (packed / self.world_size).cpu()
        loss_value = float(packed[0])
        if not math.isfinite(loss_value):
            self.optimizers.zero_grad()
            self.nan_streak += 1
            self.skipped_steps += 1
            if self.rank == 0:
                print(f"step {self.step:5d} | non-finite loss ({loss_value}) on at least one rank: step skipped "
                      f"({self.nan_streak} in a row, limit {cfg.training.max_nan_steps})", flush=True)
            return None
        self.nan_streak = 0
        max_norm = cfg.training.max_norm if cfg.training.max_norm > 0 else float("inf")
        params = [p for m in self.model_parts for p in m.parameters() if p.requires_grad]
        if self.parallel_dims.tp > 1:  # parameters on two meshes: norm per mesh group, then combined
            grad_norm = clip_grad_norm_mixed_meshes(params, max_norm)
        else:
            grad_norm = dist_utils.clip_grad_norm_(params, max_norm, foreach=True)
        self.optimizers.step()
        self.lr_schedulers.step()
        if self.step % cfg.metrics.log_freq and self.step != 1:
            return None
        per_loop, offset = {}, 1
        for k in keys:
            n = stats_sum[k].numel()
            per_loop[k] = packed[offset:offset + n].tolist()
            offset += n
        seconds = time.perf_counter() - start
        tokens = self.dataloader.batch_at(self.step - 1) * cfg.training.seq_len
        flops = cfg.looplm.flops_per_token(cfg.training.seq_len, n_loops=n_loops) * tokens / seconds
        scalars = {"loss": loss_value, "n_loops": n_loops, "gate_entropy": per_loop.pop("gate_entropy")[0],
                   "grad_norm": float(grad_norm), "lr": lr, "tokens_per_s": tokens / seconds,
                   "tflops": flops / 1e12, "skipped_steps": self.skipped_steps,
                   "mfu": flops / (H100_BF16_PEAK_FLOPS * self.world_size) if DEVICE_TYPE == "cuda" else None}
        if "jsrr" in per_loop:
            scalars["jsrr"] = per_loop.pop("jsrr")[0]
        return scalars, per_loop

    # ----- loop control and state ------------------------------------------------------------------
    def should_continue_training(self) -> bool:
        return super().should_continue_training() and self.nan_streak < self.loop_cfg.training.max_nan_steps

    def state_dict(self) -> dict:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state_dict: dict) -> None:
        self.step = state_dict["step"]
        self.ntokens_seen = state_dict["ntokens_seen"]
        self.skipped_steps = state_dict.get("skipped_steps", 0)

    def close(self) -> None:
        super().close()
        self.metrics.close()
