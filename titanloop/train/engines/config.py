"""The sections the engines read: `[parallelism]` (engine, mesh, FSDP, AC, compile), `[optimizer]` and
`[lr_scheduler]`, with their own checks, and `EngineSettings`: all an engine is given of a run's config.

`mesh_degrees(parallelism, world_size)` is the one place the (dp, tp) layout is computed from the section, for the
config check, the process group (titanloop.train.startup) and the dry run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from titanloop.config_errors import require, require_choice
from titanloop.parallel.activation_checkpoint import AC_MODES, check_kept_loops
from titanloop.parallel.float8 import Float8Section
from titanloop.parallel.fsdp import RESHARD_LOOPED
from titanloop.parallel.tensor_parallel import check_tp_torch
from titanloop.recipe.schedule_checks import check_schedule

ENGINES = ("fsdp2", "deepspeed")
OPTIMIZER_IMPLEMENTATIONS = ("auto", "fused", "foreach", "for-loop")
ZERO_STAGES = (2, 3)
ZERO_OFFLOADS = ("none", "optimizer", "optimizer+params")


@dataclass
class OptimizerSection:
    name: str = "AdamW"
    lr: float = 3e-4
    betas: list = field(default_factory=lambda: [0.9, 0.95])
    weight_decay: float = 0.1
    eps: float = 1e-8
    # auto: fused (one kernel per step) on CUDA without tensor parallelism, else foreach (fused needs one device
    # and one mesh: TP mixes DTensor and plain parameters); the CPU default stays foreach (its numbers unchanged)
    implementation: str = "auto"

    def validate(self):
        require_choice(self.name, "optimizer.name", ("AdamW", "Adam"))
        require_choice(self.implementation, "optimizer.implementation", OPTIMIZER_IMPLEMENTATIONS)
        require(self.lr > 0, "optimizer.lr", self.lr, "a learning rate > 0")
        require(
            len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
            "optimizer.betas",
            self.betas,
            "two values in [0, 1), e.g. [0.9, 0.95]",
        )
        require(self.weight_decay >= 0, "optimizer.weight_decay", self.weight_decay, "a value >= 0")

    def kwargs(self) -> dict:
        """The AdamW hyper-parameters (both engines)."""
        return {"lr": self.lr, "betas": tuple(self.betas), "weight_decay": self.weight_decay, "eps": self.eps}

    def resolved_implementation(self, device_type: str, tp: int) -> str:
        """The implementation a run uses: `implementation`, or for auto fused on CUDA without TP, else foreach;
        TP always takes for-loop (its parameters live on two meshes, which foreach and fused cannot group)."""
        if tp > 1:
            return "for-loop"
        if self.implementation == "auto":
            return "fused" if device_type == "cuda" else "foreach"
        return self.implementation


@dataclass
class LRSchedulerSection:
    """Fields of torchtitan's LRSchedulersContainer.Config (linear warmup, stable, then decay)."""

    warmup_steps: int = 200
    decay_ratio: float | None = None  # None: decay right after warmup; 0.0: constant after warmup
    decay_type: str = "linear"  # linear | sqrt | cosine
    min_lr_factor: float = 0.0
    allow_schedule_change: bool = False  # resume even if the schedule differs from the checkpoint's (else refused)

    def validate(self):
        check_schedule(self.warmup_steps, self.decay_ratio, self.decay_type, self.min_lr_factor)


@dataclass
class ParallelismSection:
    engine: str = "fsdp2"  # fsdp2 | deepspeed (ZeRO; docs/engines.md)
    zero_stage: int = 2  # deepspeed engine: 2 (optimizer + gradients partitioned) | 3 (also parameters)
    zero_offload: str = "none"  # deepspeed engine: none | optimizer | optimizer+params (stage 3) to CPU memory
    dp_shard: int = -1  # FSDP2 degree; -1 = world_size / tp
    tp: int = 1  # tensor-parallel degree (second mesh dimension)
    sequence_parallel: bool = True  # shard norms/residual stream over the sequence under TP
    reshard_looped: str = "never"  # FSDP for the looped stack: never = all-gather once per step (see docs)
    # none | selective (per layer: matmul and attention outputs saved, the rest recomputed) | layer (each layer's
    # input saved, its internals recomputed) | loop (each loop's input saved, the whole stack recomputed)
    activation_checkpoint: str = "none"
    # with activation_checkpoint = "loop": the first k loops are not checkpointed (they keep their activations, and
    # backward recomputes only the other T - k); between "loop" (0) and "none" (>= T) in steps of one loop
    ac_kept_loops: int = 0
    compile: bool = False  # torch.compile each decoder layer (compiled once, reused for every loop)
    compile_backend: str = "inductor"

    def validate(self):
        require(
            self.dp_shard == -1 or self.dp_shard >= 1,
            "parallelism.dp_shard",
            self.dp_shard,
            "-1 (all remaining ranks) or an integer >= 1",
        )
        require(self.tp >= 1, "parallelism.tp", self.tp, "an integer >= 1")
        check_tp_torch(self.tp)
        require_choice(self.reshard_looped, "parallelism.reshard_looped", RESHARD_LOOPED)
        require_choice(self.activation_checkpoint, "parallelism.activation_checkpoint", AC_MODES)
        check_kept_loops(self.activation_checkpoint, self.ac_kept_loops)
        require_choice(self.engine, "parallelism.engine", ENGINES)
        if self.engine == "deepspeed":
            check_zero_settings(self.zero_stage, self.zero_offload)
            require(
                not self.compile,
                "parallelism.compile",
                self.compile,
                "false with parallelism.engine='deepspeed' (compile is supported with engine='fsdp2' only)",
            )


def check_zero_settings(zero_stage: int, offload: str) -> None:
    """One-line ConfigError for a ZeRO stage / offload combination the DeepSpeed engine does not run."""
    require_choice(zero_stage, "parallelism.zero_stage", ZERO_STAGES)
    require_choice(offload, "parallelism.zero_offload", ZERO_OFFLOADS)
    require(
        not (offload == "optimizer+params" and zero_stage != 3),
        "parallelism.zero_offload",
        offload,
        "'none' or 'optimizer' with zero_stage=2 (parameters are partitioned, hence offloadable, only with "
        "parallelism.zero_stage=3)",
    )


def mesh_degrees(p: ParallelismSection, world_size: int) -> tuple[int, int]:
    """(dp, tp) for this world size; raises ConfigError when they do not tile the world."""
    tp = p.tp
    require(world_size % tp == 0, "parallelism.tp", tp, f"a divisor of the world size {world_size}")
    dp = world_size // tp if p.dp_shard == -1 else p.dp_shard
    require(
        dp * tp == world_size,
        "parallelism.dp_shard",
        p.dp_shard,
        f"dp_shard * tp == world size ({dp} * {tp} != {world_size}); use -1 to fill the remaining ranks",
    )
    return dp, tp


@dataclass(frozen=True)
class EngineSettings:
    """What an engine reads of a run's config (TrainConfig.engine_settings): its own sections, [float8], and the
    few values of other sections it needs."""

    parallelism: ParallelismSection
    optimizer: OptimizerSection
    lr_scheduler: LRSchedulerSection
    float8: Float8Section
    steps: int  # training.steps: the LR schedule's length
    micro_batch_size: int  # training.micro_batch_size (DeepSpeed's bookkeeping)
    max_norm: float  # training.max_norm (DeepSpeed clips inside its step)
    forward_ad: bool = False  # the objective takes Jacobian-vector products (JSRR): compile without fullgraph
