"""The training config: one TOML file with fourteen sections, every field overridable on the command line.

    [stage]          name, init_from (previous stage's checkpoint), upcycle, keep_optimizer (titanloop.recipe.stages)
    [model]          preset + any LoopLMConfig field              (titanloop.model.config)
    [objective]      ObjectiveConfig: stage1 | stage2_gate | dense | final_only, β, scale penalty, JSRR
    [loop_sampler]   LoopSamplerConfig: loops per step, fixed or sampled (same on every rank); the one home of T
    [optimizer]      AdamW hyper-parameters
    [lr_scheduler]   torchtitan's warmup-stable-decay schedule (LRSchedulersContainer.Config fields)
    [training]       steps, batch sizes, sequence length, clipping, dtype, NaN policy, run directory
    [parallelism]    data-parallel (FSDP2) and tensor-parallel degrees, FSDP resharding, AC, compile
    [data]           titanloop.data.DataConfig fields (kind = synthetic_text | synthetic_task | mds | webdataset)
    [checkpoint]     titanloop.checkpoint.CheckpointConfig: DCP checkpoints in <run_dir>/checkpoints, preemption
    [metrics]        stdout and W&B logging, step-time breakdown and straggler warning
    [validation]     held-out loss per loop, expected exit depth and Q-exit quality every `freq` steps
    [profiling]      torch.profiler traces and CUDA memory snapshots for a window of steps
    [retrofit]       RetrofitConfig: retrofit a pretrained HF checkpoint (titanloop.retrofit); off unless hf_path

`load_config(path, ["--training.steps", "10", ...])` reads the file, applies the overrides and validates
everything (including the mesh against WORLD_SIZE) before any process group exists; every problem is a
one-line ConfigError naming the field. Override values are parsed as TOML literals (`10`, `1e-3`, `true`,
`[0.9, 0.95]`, `"text"`) and fall back to a plain string.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

from titanloop.checkpoint.config import CheckpointConfig
from titanloop.config_errors import ConfigError, require, require_choice
from titanloop.data.config import DataConfig
from titanloop.data.loader import micro_batches_per_rank
from titanloop.data.synthetic_tasks import build_task
from titanloop.family import family_of
from titanloop.model.config import PRESETS, LoopLMConfig, preset
from titanloop.objectives import LoopSamplerConfig, ObjectiveConfig
from titanloop.parallel.float8 import RECIPES as FLOAT8_RECIPES
from titanloop.parallel.float8 import check_float8_layout
from titanloop.recipe.schedule_checks import check_schedule
from titanloop.recipe.stages import StageSection
from titanloop.retrofit.config import RetrofitConfig
from titanloop.recipe.schedules import BatchRamp
from titanloop.train.engines import check_engine_config

DTYPES = ("auto", "float32", "bfloat16")
WANDB_MODES = ("off", "online", "offline")
AC_MODES = ("none", "layer", "loop")
RESHARD_LOOPED = ("never", "always")
ENGINES = ("fsdp2", "deepspeed")


@dataclass
class ModelSection:
    """`preset` names a size in titanloop.model.config.PRESETS; other keys override LoopLMConfig fields."""

    preset: str = "debug-tiny"
    overrides: dict = field(default_factory=dict)
    looplm: LoopLMConfig = field(init=False, repr=False)  # the resolved model shape, built (and checked) once

    def __post_init__(self):
        require_choice(self.preset, "model.preset", sorted(PRESETS))
        self.looplm = preset(self.preset, **self.overrides)


@dataclass
class OptimizerSection:
    name: str = "AdamW"
    lr: float = 3e-4
    betas: list = field(default_factory=lambda: [0.9, 0.95])
    weight_decay: float = 0.1
    eps: float = 1e-8

    def validate(self):
        require_choice(self.name, "optimizer.name", ("AdamW", "Adam"))
        require(self.lr > 0, "optimizer.lr", self.lr, "a learning rate > 0")
        require(
            len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
            "optimizer.betas",
            self.betas,
            "two values in [0, 1), e.g. [0.9, 0.95]",
        )
        require(self.weight_decay >= 0, "optimizer.weight_decay", self.weight_decay, "a value >= 0")


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
class TrainingSection:
    run_dir: str = "runs/debug"  # checkpoints, W&B files and the run id live here
    steps: int = 100
    seq_len: int = 128
    micro_batch_size: int = 4  # sequences per rank per forward
    global_batch_size: int = 8  # sequences per optimizer step, over all data-parallel ranks
    max_norm: float = 1.0  # gradient clipping (0 = off)
    seed: int = 0
    dtype: str = "auto"  # auto: bf16 parameters + fp32 reduce on GPU, fp32 on CPU
    # float8 matmuls in the decoder layers' linears (torchao; LM head, gates, embedding stay high precision):
    # off | tensorwise | rowwise; emulated without a GPU (titanloop.parallel.float8, docs/parallelism.md)
    float8: str = "off"
    doc_masking: bool = True  # attend within each packed document only (no dense mask: flash varlen / flex /
    #                          SDPA per document, see titanloop.model.attention; false: plain causal)
    max_nan_steps: int = 3  # stop after this many non-finite steps in a row (each one is skipped)
    # A non-finite loss (any rank) or gradient norm: skip the step (until max_nan_steps in a row) or stop at once;
    # either way <run_dir>/nonfinite/step-N.rank-R.json records the step (loss, T, non-finite gradients)
    on_nonfinite: str = "skip"  # skip | stop
    # Batch-size ramp (Ouro stage 1: 4M -> 8M tokens): global batch in sequences from batch_ramp_start to
    # global_batch_size over batch_ramp_steps steps, in stairs of batch_ramp_increment (titanloop.recipe.schedules)
    batch_ramp_start: int = 0  # 0 = no ramp
    batch_ramp_steps: int = 0
    batch_ramp_increment: int = 0  # 0 = batch_ramp_start
    # testing aids (titanloop.train.fault_injection wraps the engine only when set): the last rank's loss is NaN at
    # these steps / a NaN gradient on the last rank
    inject_nan_steps: list = field(default_factory=list)
    inject_nan_grad_steps: list = field(default_factory=list)

    def validate(self):
        require(self.steps >= 1, "training.steps", self.steps, "an integer >= 1")
        require(self.seq_len >= 2, "training.seq_len", self.seq_len, "an integer >= 2")
        require(self.micro_batch_size >= 1, "training.micro_batch_size", self.micro_batch_size, "an integer >= 1")
        require(self.global_batch_size >= 1, "training.global_batch_size", self.global_batch_size, "an integer >= 1")
        require(self.max_norm >= 0, "training.max_norm", self.max_norm, "a value >= 0 (0 disables clipping)")
        require_choice(self.dtype, "training.dtype", DTYPES)
        require_choice(self.float8, "training.float8", FLOAT8_RECIPES)
        require(self.max_nan_steps >= 1, "training.max_nan_steps", self.max_nan_steps, "an integer >= 1")
        require_choice(self.on_nonfinite, "training.on_nonfinite", ("skip", "stop"))
        self.batch_ramp()  # validates the ramp fields

    def batch_ramp(self):
        """The BatchRamp of this config, or None without a ramp."""
        if self.batch_ramp_start == 0:
            return None

        return BatchRamp(
            start=self.batch_ramp_start,
            end=self.global_batch_size,
            ramp_steps=self.batch_ramp_steps,
            increment=self.batch_ramp_increment or self.batch_ramp_start,
        )


@dataclass
class ParallelismSection:
    engine: str = "fsdp2"  # fsdp2 | deepspeed (ZeRO; docs/engines.md)
    zero_stage: int = 2  # deepspeed engine: 2 (optimizer + gradients partitioned) | 3 (also parameters)
    zero_offload: str = "none"  # deepspeed engine: none | optimizer | optimizer+params (stage 3) to CPU memory
    dp_shard: int = -1  # FSDP2 degree; -1 = world_size / tp
    tp: int = 1  # tensor-parallel degree (second mesh dimension)
    sequence_parallel: bool = True  # shard norms/residual stream over the sequence under TP
    reshard_looped: str = "never"  # FSDP for the looped stack: never = all-gather once per step (see docs)
    activation_checkpoint: str = "none"  # none | layer | loop
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
        require_choice(self.reshard_looped, "parallelism.reshard_looped", RESHARD_LOOPED)
        require_choice(self.activation_checkpoint, "parallelism.activation_checkpoint", AC_MODES)
        require_choice(self.engine, "parallelism.engine", ENGINES)
        check_engine_config(self)  # each engine's own settings, checked beside the engine


@dataclass
class MetricsSection:
    log_freq: int = 1  # steps between metric lines
    wandb: str = "off"  # off | online | offline (WANDB_MODE=offline in the environment also forces offline)
    wandb_project: str = "titanloop"
    wandb_entity: str | None = None
    run_name: str | None = None
    # count each step's collectives (CommDebugMode) and log them as comm/<kind>; with training.float8 also the float8
    # weight casts (comm/float8_weight_cast, eager mode only)
    count_comms: bool = False
    # Step-time breakdown on log steps (titanloop.train.step_timer): data wait, forward + objective, backward,
    # loss all-reduce, optimizer; a barrier ends each phase on log steps only, so waiting for other ranks is its
    # own row and the slowest rank can be named. false: no barriers, no breakdown.
    breakdown: bool = True
    straggler_warn: float = 0.0  # warn when a rank's busy time is this many times the median rank's (0 = never)

    def validate(self):
        require(self.log_freq >= 1, "metrics.log_freq", self.log_freq, "an integer >= 1")
        require_choice(self.wandb, "metrics.wandb", WANDB_MODES)
        require(
            self.straggler_warn == 0 or self.straggler_warn > 1,
            "metrics.straggler_warn",
            self.straggler_warn,
            "0 (off) or a ratio > 1, e.g. 1.5 (warn when a rank is 1.5x slower than the median)",
        )


@dataclass
class ValidationSection:
    """Held-out evaluation during training (titanloop.train.validation); off unless enable = true."""

    enable: bool = False
    freq: int = 1000  # steps between validations (also at the last step)
    steps: int = 4  # batches per data-parallel rank
    batch_size: int = 0  # rows per batch per data-parallel rank (0 = training.micro_batch_size)
    loops: list = field(default_factory=list)  # loop counts T to score ([] = 1..T_train and 2 x T_train)
    q: list = field(default_factory=lambda: [0.5, 0.8, 0.9])  # Q-exit thresholds (ouro §3.2) over T_train loops
    # The held-out set: a titanloop.data DataConfig table ([validation.data]). {} = derived from [data]: a
    # synthetic task's held-out split (split = "eval"), or synthetic text with seed + 1; shard sets need their own.
    data: dict = field(default_factory=dict)
    held_out: DataConfig | None = field(init=False, repr=False, default=None)  # `data` resolved (and checked)

    def validate(self, train_data: DataConfig):
        require(self.freq >= 1, "validation.freq", self.freq, "an integer >= 1 (steps between validations)")
        require(self.steps >= 1, "validation.steps", self.steps, "an integer >= 1 (batches per data-parallel rank)")
        require(
            self.batch_size >= 0,
            "validation.batch_size",
            self.batch_size,
            "an integer >= 1, or 0 for training.micro_batch_size",
        )
        for t in self.loops:
            require(
                isinstance(t, int) and not isinstance(t, bool) and t >= 1,
                "validation.loops",
                t,
                "integers >= 1 (loop counts T)",
            )
        for q in self.q:
            require(isinstance(q, (int, float)) and 0 <= q <= 1, "validation.q", q, "thresholds in [0, 1]")
        if self.data:
            self.held_out = DataConfig.from_dict(self.data)
        elif train_data.kind == "synthetic_task":
            self.held_out = dataclasses.replace(train_data, split="eval", trace_samples=None)
        elif train_data.kind == "synthetic_text":
            self.held_out = dataclasses.replace(train_data, seed=train_data.seed + 1, trace_samples=None)
        elif self.enable:
            raise ConfigError(
                f"validation.data is empty with data.kind={train_data.kind!r}: give the held-out shard "
                "sets as [validation.data] kind = ..., sources = [{path = ...}]"
            )


@dataclass
class ProfilingSection:
    """torch.profiler traces and CUDA memory snapshots for a window of steps (titanloop.train.profiling)."""

    enable: bool = False
    start_step: int = 10  # first profiled step
    steps: int = 2  # steps in the window
    memory_snapshot: bool = True  # CUDA only: record allocator history over the window, dump a pickle (+ on OOM)
    memory_snapshot_entries: int = 100000  # allocator events kept

    def validate(self):
        require(self.start_step >= 1, "profiling.start_step", self.start_step, "an integer >= 1")
        require(self.steps >= 1, "profiling.steps", self.steps, "an integer >= 1")
        require(
            self.memory_snapshot_entries >= 1,
            "profiling.memory_snapshot_entries",
            self.memory_snapshot_entries,
            "an integer >= 1",
        )


@dataclass
class TrainConfig:
    stage: StageSection = field(default_factory=StageSection)
    model: ModelSection = field(default_factory=ModelSection)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    loop_sampler: LoopSamplerConfig = field(default_factory=LoopSamplerConfig)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    lr_scheduler: LRSchedulerSection = field(default_factory=LRSchedulerSection)
    training: TrainingSection = field(default_factory=TrainingSection)
    parallelism: ParallelismSection = field(default_factory=ParallelismSection)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    retrofit: RetrofitConfig = field(default_factory=RetrofitConfig)  # used when retrofit.hf_path is set
    validation: ValidationSection = field(default_factory=ValidationSection)
    profiling: ProfilingSection = field(default_factory=ProfilingSection)
    source: str | None = None  # the TOML file this came from

    @property
    def looplm(self) -> LoopLMConfig:
        """The model's shape (its family's view: for a retrofit run, read from the HF checkpoint's config.json)."""
        return family_of(self).shape(self)

    def to_dict(self) -> dict:
        """Plain, JSON-serializable view (what W&B receives as its config; contains no secrets)."""
        d = dataclasses.asdict(self)
        # the derived default depth too: a checkpoint's model config then loads at the depth it was trained at
        d["model"] = {"preset": self.model.preset, **self.model.overrides, "n_loops": self.model.looplm.n_loops}
        d["validation"].pop("held_out", None)
        return d


SECTIONS = [f.name for f in dataclasses.fields(TrainConfig) if f.name != "source"]


def _coerce(value, typ, name: str):
    """Check/convert a TOML or command-line value to the dataclass field type."""
    origin = typing.get_origin(typ)
    args = typing.get_args(typ)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        typ = next(a for a in args if a is not type(None))
    if typ is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{name}={value!r} is invalid: expected true or false")
    if typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{name}={value!r} is invalid: expected an integer")
    if typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{name}={value!r} is invalid: expected a number")
    if typ is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{name}={value!r} is invalid: expected a string")
    if typ in (list, dict) or typing.get_origin(typ) in (list, dict):
        want = typing.get_origin(typ) or typ
        if isinstance(value, want):
            return value
        raise ConfigError(f"{name}={value!r} is invalid: expected a {want.__name__}")
    return value


def _field_types(cls) -> dict:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def _build_section(name: str, cls, values: dict):
    types = _field_types(cls)
    unknown = sorted(set(values) - set(types))
    if unknown:
        raise ConfigError(f"[{name}] has unknown key(s) {unknown}: allowed keys are {sorted(types)}")
    kwargs = {k: _coerce(v, types[k], f"{name}.{k}") for k, v in values.items()}
    return cls(**kwargs)


def _build_model(values: dict) -> ModelSection:
    values = dict(values)
    name = values.pop("preset", ModelSection.preset)
    if not isinstance(name, str):
        raise ConfigError(f"model.preset={name!r} is invalid: expected one of {sorted(PRESETS)}")
    types = _field_types(LoopLMConfig)
    unknown = sorted(set(values) - set(types))
    if unknown:
        raise ConfigError(
            f"[model] has unknown key(s) {unknown}: allowed keys are ['preset', "
            f"{', '.join(repr(k) for k in sorted(types))}]"
        )
    overrides = {k: _coerce(v, types[k], f"model.{k}") for k, v in values.items()}
    return ModelSection(preset=name, overrides=overrides)


def _build_data(values: dict) -> DataConfig:
    return DataConfig.from_dict(values)  # validates kind, sources, ... (one-line ConfigError)


def _parse_literal(text: str):
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def parse_overrides(args: list[str]) -> dict[str, dict]:
    """["--training.steps", "10", "--data.kind=mds"] -> {"training": {"steps": 10}, "data": {"kind": "mds"}}."""
    out: dict[str, dict] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(
                f"argument {arg!r} is invalid: expected --<section>.<key> <value> with a section in {SECTIONS}"
            )
        if "=" in arg:
            key, text = arg[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"argument {arg!r} has no value: expected {arg} <value>")
            key, text = arg[2:], args[i + 1]
            i += 2
        section, name = key.split(".", 1)
        if section not in SECTIONS:
            raise ConfigError(f"argument --{key} names unknown section {section!r}: expected one of {SECTIONS}")
        out.setdefault(section, {})[name] = _parse_literal(text)
    return out


def load_config(
    path: str | os.PathLike | None, overrides: list[str] | None = None, world_size: int | None = None
) -> TrainConfig:
    """Read a TOML file (None = all defaults), apply `--section.key value` overrides and validate.

    world_size (default: $WORLD_SIZE, else 1) is checked against the parallelism section here, so a bad
    mesh fails before torch.distributed is initialized.
    """
    raw: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist: pass --config train_configs/<name>.toml")
        try:
            raw = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {str(path)!r} is not valid TOML: {e}") from None
    unknown = sorted(set(raw) - set(SECTIONS))
    if unknown:
        raise ConfigError(f"config has unknown section(s) {unknown}: allowed sections are {SECTIONS}")
    for section, values in parse_overrides(overrides or []).items():
        raw.setdefault(section, {}).update(values)
    for section, values in raw.items():
        if not isinstance(values, dict):
            raise ConfigError(f"config entry {section!r} must be a [section] table")

    cfg = TrainConfig(
        stage=_build_section("stage", StageSection, raw.get("stage", {})),
        model=_build_model(raw.get("model", {})),
        objective=_build_section("objective", ObjectiveConfig, raw.get("objective", {})),
        loop_sampler=_build_section("loop_sampler", LoopSamplerConfig, raw.get("loop_sampler", {})),
        optimizer=_build_section("optimizer", OptimizerSection, raw.get("optimizer", {})),
        lr_scheduler=_build_section("lr_scheduler", LRSchedulerSection, raw.get("lr_scheduler", {})),
        training=_build_section("training", TrainingSection, raw.get("training", {})),
        parallelism=_build_section("parallelism", ParallelismSection, raw.get("parallelism", {})),
        data=_build_data(raw.get("data", {})),
        checkpoint=_build_section("checkpoint", CheckpointConfig, raw.get("checkpoint", {})),
        metrics=_build_section("metrics", MetricsSection, raw.get("metrics", {})),
        retrofit=_build_section("retrofit", RetrofitConfig, raw.get("retrofit", {})),
        validation=_build_section("validation", ValidationSection, raw.get("validation", {})),
        profiling=_build_section("profiling", ProfilingSection, raw.get("profiling", {})),
        source=str(path) if path is not None else None,
    )
    for section in (
        cfg.stage,
        cfg.optimizer,
        cfg.lr_scheduler,
        cfg.training,
        cfg.parallelism,
        cfg.metrics,
        cfg.profiling,
    ):
        section.validate()
    cfg.validation.validate(cfg.data)
    validate_layout(cfg, int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size)
    one_loop_count(cfg, raw.get("retrofit", {}))
    return cfg


def one_loop_count(cfg: TrainConfig, retrofit_values: dict) -> None:
    """T has one home, `[loop_sampler] n_loops` (the fixed T; for a sampled T the default inference depth). The
    model's default depth (`model.n_loops`, `retrofit.n_loops`) is derived from it here; a config that sets either
    to another value is refused in one line naming both fields."""
    t = cfg.loop_sampler.n_loops
    for name, value in (
        ("model.n_loops", cfg.model.overrides.get("n_loops")),
        ("retrofit.n_loops", retrofit_values.get("n_loops")),
    ):
        if value is not None and value != t:
            raise ConfigError(
                f"{name}={value} and loop_sampler.n_loops={t} disagree: the loop count T has one home, "
                f"[loop_sampler] n_loops; remove {name}"
            )
    m = cfg.model.looplm  # (a LoopLM's family check bounds T by max_loops; a retrofit does not use this section)
    cfg.model.overrides.pop("n_loops", None)
    cfg.model.looplm = m.replace(n_loops=t, max_loops=max(m.max_loops, t))
    cfg.retrofit.n_loops = t


def mesh_degrees(cfg: TrainConfig, world_size: int) -> tuple[int, int]:
    """(dp, tp) for this world size; raises ConfigError when they do not tile the world."""
    tp = cfg.parallelism.tp
    require(world_size % tp == 0, "parallelism.tp", tp, f"a divisor of the world size {world_size}")
    dp = world_size // tp if cfg.parallelism.dp_shard == -1 else cfg.parallelism.dp_shard
    require(
        dp * tp == world_size,
        "parallelism.dp_shard",
        cfg.parallelism.dp_shard,
        f"dp_shard * tp == world size ({dp} * {tp} != {world_size}); use -1 to fill the remaining ranks",
    )
    return dp, tp


def validate_layout(cfg: TrainConfig, world_size: int) -> None:
    """Cross-section checks that need the world size: mesh, TP vs heads, batch divisibility, loops."""
    dp, tp = mesh_degrees(cfg, world_size)
    require(
        not (tp > 1 and cfg.parallelism.engine == "deepspeed"),
        "parallelism.tp",
        tp,
        "1 with parallelism.engine='deepspeed' (ZeRO is data-parallel only; use engine='fsdp2' for tensor parallelism)",
    )
    require(
        not (
            cfg.parallelism.engine == "deepspeed" and cfg.parallelism.zero_stage == 3 and cfg.objective.jsrr_weight > 0
        ),
        "objective.jsrr_weight",
        cfg.objective.jsrr_weight,
        "0 with ZeRO-3 (its parameter gathering has no forward-mode AD for JSRR's Jacobian-vector products; "
        "use parallelism.zero_stage=2 or engine='fsdp2')",
    )
    check_float8_layout(cfg, tp, family_of(cfg).float8)  # titanloop.parallel.float8
    m = cfg.looplm
    require(
        m.n_heads % tp == 0 and m.kv_heads % tp == 0,
        "parallelism.tp",
        tp,
        f"a divisor of model.n_heads={m.n_heads} and of the kv heads={m.kv_heads}",
    )
    require(
        m.ffn_hidden_size % tp == 0, "parallelism.tp", tp, f"a divisor of model.ffn_hidden_size={m.ffn_hidden_size}"
    )
    require(m.vocab_size % tp == 0, "parallelism.tp", tp, f"a divisor of model.vocab_size={m.vocab_size}")
    require(
        not (tp > 1 and m.tie_embeddings),
        "model.tie_embeddings",
        True,
        "false under tensor parallelism (the embedding is vocab-sharded, the LM head replicated)",
    )
    require(
        not (tp > 1 and cfg.objective.jsrr_weight > 0),
        "objective.jsrr_weight",
        cfg.objective.jsrr_weight,
        "0 under tensor parallelism (the JSRR Jacobian-vector product runs on unsharded layers only)",
    )
    t = cfg.training
    if tp > 1 and cfg.parallelism.sequence_parallel:
        require(
            t.seq_len % tp == 0,
            "training.seq_len",
            t.seq_len,
            f"a multiple of parallelism.tp={tp} (sequence parallelism splits the sequence)",
        )
    micro_batches_per_rank(t.global_batch_size, t.micro_batch_size, dp)
    require(t.seq_len <= m.max_seq_len, "training.seq_len", t.seq_len, f"<= model.max_seq_len={m.max_seq_len}")
    ramp = t.batch_ramp()
    if ramp is not None:
        ramp.check_layout(t.micro_batch_size, dp)
    min_loops, max_loops = cfg.loop_sampler.bounds()
    family_of(cfg).check_layout(cfg, tp, max_loops)
    if cfg.validation.enable:
        check_validation_layout(cfg, m)
    if cfg.objective.name == "stage2_gate":
        require(min_loops >= 2, "loop_sampler", min_loops, ">= 2 loops per step for objective.name='stage2_gate'")


def validation_loops(cfg: TrainConfig) -> list[int]:
    """The loop counts validation scores: validation.loops, or 1..T_train and 2 x T_train (T_train: the model's
    n_loops, the depth titanloop.eval treats as trained; capped at max_loops with per_loop_norm)."""
    m, t = cfg.looplm, cfg.loop_sampler.n_loops  # T's one home (the model's depth is derived from it)
    loops = cfg.validation.loops or [*range(1, t + 1), 2 * t]
    if m.per_loop_norm and not cfg.validation.loops:
        loops = [t for t in loops if t <= m.max_loops]
    return sorted(set(loops))


def check_validation_layout(cfg: TrainConfig, m: LoopLMConfig) -> None:
    v = cfg.validation
    require(
        family_of(cfg).reads_out_every_loop,
        "validation.enable",
        True,
        "false for a retrofit run (validation "
        "scores LoopLM readouts at every loop; a retrofit model decodes its last recurrence step only)",
    )
    if m.per_loop_norm:
        require(
            max(validation_loops(cfg)) <= m.max_loops,
            "validation.loops",
            v.loops,
            f"loop counts <= model.max_loops={m.max_loops} (per_loop_norm has one norm per loop)",
        )
    d = v.held_out
    if d.kind == "synthetic_task" and d.split == "eval":
        options = {k: val for k, val in d.task_options.items() if k != "train_size"}
        vocab = build_task(d.task, seed=d.seed, **options).vocab_size
        require(
            vocab <= m.vocab_size,
            "validation.data.task",
            d.task,
            f"a task whose vocabulary ({vocab}) fits model.vocab_size={m.vocab_size}",
        )
