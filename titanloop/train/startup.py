"""Everything a training run builds before its first step, as a sequence of small functions:

    load_config (titanloop.train.config: every check that needs no process group, one-line errors)
    -> init_mesh        process group (torchtitan's init_distributed) + ParallelDims and its device meshes
    -> build_model      the LoopLM on the meta device (seeded: the same full weights on every layout)
    -> build_stage_engine  parallelize (TP/AC/compile/FSDP2), allocate and initialize this rank's shards (or load
                        the previous stage's weights into them), optimizer, LR schedule (titanloop.train.engines)
    -> build_data       this data-parallel rank's loader (titanloop.data)
    -> build_checkpointer  atomic DCP checkpoints of engine, loader and TrainState (titanloop.checkpoint)

`build_run(cfg)` runs them in that order and returns the `Run` the loop (titanloop.train.loop) drives.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torchtitan.config import CommConfig
from torchtitan.distributed import utils as dist_utils
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.tools import utils as tt_utils

from titanloop.checkpoint import Checkpointer, layout
from titanloop.data import PackedLoader, build_dataloader
from titanloop.family import trained_depth
from titanloop.objectives import LoopSampler
from titanloop.train.config import TrainConfig
from titanloop.train.cpu_shim import use_cpu_if_no_gpu
from titanloop.recipe import stages
from titanloop.train.engines import Engine, build_engine
from titanloop.train.engines.config import mesh_degrees
from titanloop.train.fault_injection import with_fault_injection

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class Mesh:
    """The process group's layout: torchtitan's ParallelDims and the meshes and ranks the run uses."""

    dims: ParallelDims
    device: torch.device
    device_type: str  # "cuda" or "cpu"
    rank: int
    world_size: int
    dp_rank: int
    dp_world: int
    tp_mesh: DeviceMesh | None
    sp_mesh: DeviceMesh | None  # the tp mesh under sequence parallelism (the objective gathers the sequence)


@dataclass
class TrainState:
    """The loop's counters; step/ntokens_seen/skipped_steps are checkpointed ("train_state")."""

    step: int = 0
    ntokens_seen: int = 0
    skipped_steps: int = 0  # non-finite steps skipped so far
    nan_streak: int = 0  # non-finite steps in a row (not saved: a resumed run starts a new streak)
    exit_code: int | None = None  # set by a callback to stop the loop (3: non-finite losses, 75: preempted)

    def state_dict(self) -> dict:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state_dict: dict) -> None:
        self.step = state_dict["step"]
        self.ntokens_seen = state_dict["ntokens_seen"]
        self.skipped_steps = state_dict.get("skipped_steps", 0)


@dataclass
class Run:
    cfg: TrainConfig
    mesh: Mesh
    engine: Engine
    dataloader: PackedLoader
    checkpointer: Checkpointer
    loop_sampler: LoopSampler
    n_params: int
    param_dtype: torch.dtype
    state: TrainState = field(default_factory=TrainState)
    n_trainable: int = 0  # parameters the optimizer updates (all but frozen ones: stage II, retrofit base)
    startup: dict = field(default_factory=dict)  # seconds of each part of build_run (start_up_seconds)

    def close(self) -> None:
        # Stop the loader's prefetch thread before the interpreter shuts down: a thread still building a batch
        # during teardown can abort the process after a successful run ("terminate called without an active
        # exception", seen in CI).
        self.dataloader.close()
        self.checkpointer.close()


def default_comm() -> CommConfig:
    return CommConfig(init_timeout_seconds=300, train_timeout_seconds=300, trace_buf_size=0)


def single_process_env() -> bool:
    """`python -m titanloop.train ...` without torchrun: one process, world size 1, a rendezvous on a free local
    port. Sets what torchrun would set (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT)
    unless a launcher already did; True when it did. Saves the launcher's own start-up (a second interpreter that
    imports torch) for one-process runs."""
    if "RANK" in os.environ or "WORLD_SIZE" in os.environ:
        return False
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    return True


def init_mesh(cfg: TrainConfig, comm: CommConfig | None = None) -> Mesh:
    """Initialize torch.distributed (torchtitan's init_distributed: gloo on CPU, NCCL on GPU, or the fake
    backend of comm.mode='fake_backend') and build the dp x tp meshes."""
    device_type = use_cpu_if_no_gpu()
    device = tt_utils.get_local_device()
    tt_utils.device_module.set_device(device)
    world_size = dist_utils.init_distributed(comm or default_comm(), base_folder=cfg.training.run_dir)
    dp, tp = mesh_degrees(cfg.parallelism, world_size)
    dims = ParallelDims(
        dp_replicate=1, dp_shard=dp, cp=1, tp=tp, pp=1, ep=1, world_size=world_size, spmd_backend="partial_dtensor"
    )
    dims.build_mesh()
    tp_mesh = dims.get_optional_mesh("tp")
    batch_mesh = dims.get_optional_mesh("batch")
    dp_rank, dp_world = (batch_mesh.get_local_rank(), batch_mesh.size()) if batch_mesh else (0, 1)
    return Mesh(
        dims,
        device,
        device_type,
        dist.get_rank(),
        dist.get_world_size(),
        dp_rank,
        dp_world,
        tp_mesh,
        tp_mesh if cfg.parallelism.sequence_parallel else None,
    )


def param_dtype(cfg: TrainConfig, device_type: str) -> torch.dtype:
    if cfg.training.dtype == "auto":
        return torch.bfloat16 if device_type == "cuda" else torch.float32
    return _DTYPES[cfg.training.dtype]


def run_dir_has_checkpoint(cfg: TrainConfig) -> bool:
    root = Path(cfg.training.run_dir) / cfg.checkpoint.folder
    return cfg.checkpoint.enable and layout.latest_step(root) is not None


def build_model(cfg: TrainConfig, load_weights: bool = True) -> nn.Module:
    """The run's model, built by its family (titanloop.family): a LoopLM on the meta device (no memory yet;
    build_engine allocates each rank's shards after parallelizing, titanloop.model.init), or a retrofit with its
    pretrained weights (load_weights=False: on the meta device from config.json only, for the dry run). Seeded
    here, so every layout gets the same full weights. Stage II trains only the exit gate (ouro §3.4)."""
    torch.manual_seed(cfg.training.seed)
    # Python's and NumPy's global RNGs too (titanloop draws from neither, user code might): checkpoints save and
    # restore them, and a resumed run then matches an uninterrupted one in every saved state.
    random.seed(cfg.training.seed)
    np.random.seed(cfg.training.seed)
    model = cfg.family.build(load_weights)
    if cfg.objective.name == "stage2_gate":
        for name, p in model.named_parameters():
            p.requires_grad_(name.startswith("early_exit_gate."))
    return model


def build_stage_engine(cfg: TrainConfig, model: nn.Module, mesh: Mesh, dtype: torch.dtype, stage_init: bool) -> Engine:
    """The engine `parallelism.engine` names (titanloop.train.engines); a new stage (stage_init) starts from the
    previous stage's weights and, where the stage keeps it, its optimizer state (titanloop.recipe.stages). This is
    the one place a stage is initialized, for either engine."""

    def previous_stage_weights(module: nn.Module) -> None:
        stages.load_stage_weights(module, cfg.stage, stages.previous_stage_state(cfg.stage, module))

    engine = build_engine(cfg.engine_settings(), model, mesh, dtype, previous_stage_weights if stage_init else None)
    if stage_init and stages.keeps_optimizer(cfg.stage, cfg.objective.name):
        stages.load_previous_stage_optimizer(cfg.stage, engine.optimizer_state(), engine.lr_schedulers)
    return engine


def build_data(cfg: TrainConfig, mesh: Mesh) -> PackedLoader:
    t = cfg.training
    ramp = t.batch_ramp()  # per-step global batch (stage-1 ramp) or None
    return build_dataloader(
        cfg.data,
        seq_len=t.seq_len,
        micro_batch_size=t.micro_batch_size,
        global_batch_size=t.global_batch_size,
        dp_rank=mesh.dp_rank,
        dp_world=mesh.dp_world,
        vocab_size=cfg.looplm.vocab_size,
        batch_schedule=ramp.batch_at if ramp else None,
        pin_memory=mesh.device_type == "cuda",
    )


def build_checkpointer(cfg: TrainConfig, engine: Engine, dataloader: PackedLoader, state: TrainState) -> Checkpointer:
    """<run_dir>/checkpoints/step-N (DCP, reshardable) with model, optimizer, LR schedule, the data loader's
    global position, the train state, per-rank RNG, the resolved config, the stage name and the trained depth (the
    loop sampler's T, which evaluation and export read back; docs/checkpointing.md)."""
    states = {**engine.checkpoint_states(), "dataloader": dataloader, "train_state": state}
    return Checkpointer(
        cfg.checkpoint,
        cfg.training.run_dir,
        states,
        config=cfg.to_dict(),
        stage=cfg.stage.name or os.environ.get("TITANLOOP_STAGE"),
        trained_depth=trained_depth(cfg.loop_sampler),
    )


def build_run(cfg: TrainConfig, comm: CommConfig | None = None) -> Run:
    clock = _Clock()
    mesh = clock("mesh", init_mesh(cfg, comm))
    stage_init = bool(cfg.stage.init_from) and not run_dir_has_checkpoint(cfg)  # else: auto-resume as usual
    model = clock("model", build_model(cfg))
    unique = {id(p): p for p in model.parameters()}.values()
    n_params, n_trainable = sum(p.numel() for p in unique), sum(p.numel() for p in unique if p.requires_grad)
    dtype = param_dtype(cfg, mesh.device_type)
    state = TrainState()
    engine = with_fault_injection(build_stage_engine(cfg, model, mesh, dtype, stage_init), cfg.training, state, mesh)
    clock("engine", engine)  # parallelize, this rank's shards, optimizer, LR schedule (previous stage)
    loop_sampler = LoopSampler(cfg.loop_sampler, cfg.training.steps)
    dataloader = clock("data", build_data(cfg, mesh))
    checkpointer = clock("checkpointer", build_checkpointer(cfg, engine, dataloader, state))
    run = Run(cfg, mesh, engine, dataloader, checkpointer, loop_sampler, n_params, dtype, state, n_trainable)
    run.startup = clock.seconds
    return run


class _Clock:
    """clock(name, value) -> value, recording the seconds since the previous call (or since the clock was made)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.last = time.perf_counter()

    def __call__(self, name: str, value):
        now = time.perf_counter()
        self.seconds[name] = now - self.last
        self.last = now
        return value


def start_up_seconds(process_seconds: float | None = None) -> dict:
    """Seconds since this process started (`process`: interpreter, imports, config; read from /proc, Linux) and,
    when a launcher such as torchrun started it, from the launcher's start to this process's (`launcher`); None
    where /proc cannot tell."""
    out = {"process": process_seconds if process_seconds is not None else _age(os.getpid())}
    out["launcher"] = (
        None
        if "TORCHELASTIC_RUN_ID" not in os.environ or out["process"] is None or _age(os.getppid()) is None
        else _age(os.getppid()) - out["process"]
    )
    return out


def _age(pid: int) -> float | None:
    """Seconds since process `pid` started (/proc/<pid>/stat's start time; 10 ms resolution), None off Linux."""
    try:
        start_ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
