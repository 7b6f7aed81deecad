"""The training config: one TOML file of sections, every field overridable on the command line.

Each section is a dataclass beside the code that reads it; this module lists them, reads the file and holds the
checks that span sections:

    [stage]          StageSection: name, init_from, upcycle, keep_optimizer             titanloop.recipe.stages
    [model]          ModelSection: preset + LoopLMConfig field overrides                titanloop.model.config
    [objective]      ObjectiveConfig: stage1 | stage2_gate | dense | final_only, β, JSRR titanloop.objectives
    [loop_sampler]   LoopSamplerConfig: loops per step, fixed or sampled; T's one home    titanloop.objectives
    [optimizer]      OptimizerSection: AdamW hyper-parameters                           titanloop.train.engines.config
    [lr_scheduler]   LRSchedulerSection: torchtitan's warmup-stable-decay schedule      titanloop.train.engines.config
    [training]       TrainingSection: steps, batches, sequence length, dtype, NaN policy titanloop.train.training
    [parallelism]    ParallelismSection: engine, dp/tp degrees, FSDP, AC, compile       titanloop.train.engines.config
    [float8]         Float8Section: float8 matmuls of the decoder layers (torchao)       titanloop.parallel.float8
    [data]           DataConfig: synthetic_text | synthetic_task | mds | webdataset      titanloop.data.config
    [checkpoint]     CheckpointConfig: DCP checkpoints, retention, preemption            titanloop.checkpoint.config
    [metrics]        MetricsSection: stdout, metrics.jsonl, W&B, step-time breakdown     titanloop.train.metrics
    [validation]     ValidationSection: held-out loss per loop every `freq` steps        titanloop.train.validation
    [profiling]      ProfilingSection: torch.profiler traces, CUDA memory snapshots      titanloop.train.profiling
    [retrofit]       RetrofitSection: retrofit a pretrained HF checkpoint (if hf_path)   titanloop.retrofit.config

`load_config(path, ["--training.steps", "10", ...])` reads the file, applies the overrides and validates
everything (including the mesh against WORLD_SIZE) before any process group exists; every problem is a
one-line ConfigError naming the field. A key that has moved (MOVED) is refused in one line naming its new home.
Override values are parsed as TOML literals (`10`, `1e-3`, `true`, `[0.9, 0.95]`, `"text"`) and fall back to a
plain string.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass, field

from titanloop.checkpoint.config import CheckpointConfig
from titanloop.config_errors import ConfigError, require
from titanloop.config_fields import build_section, parse_section_overrides, read_toml, refuse_moved
from titanloop.data.config import DataConfig
from titanloop.data.loader import micro_batches_per_rank
from titanloop.data.synthetic_tasks import build_task
from titanloop.family import LoopLMFamily, RetrofitFamily, family_of
from titanloop.model.config import LoopLMConfig, ModelSection
from titanloop.objectives import LoopSamplerConfig, ObjectiveConfig
from titanloop.parallel.float8 import Float8Section, check_float8_layout
from titanloop.recipe.stages import StageSection
from titanloop.retrofit.config import RetrofitSection
from titanloop.train.engines.config import (
    EngineSettings,
    LRSchedulerSection,
    OptimizerSection,
    ParallelismSection,
    mesh_degrees,
)
from titanloop.train.metrics import MetricsSection
from titanloop.train.profiling import ProfilingSection
from titanloop.train.training import TrainingSection
from titanloop.train.validation import ValidationSection

# Keys that moved or went: refused in one line naming their new home (old TOML files, old command lines).
MOVED = {
    "model.n_loops": "loop_sampler.n_loops",
    "retrofit.n_loops": "loop_sampler.n_loops",
    "retrofit.max_loops": "model.max_loops",
    "retrofit.gated_recurrence": "model.gated_recurrence",
    "retrofit.gate_bias_init": "model.gate_bias_init",
    "training.float8": "float8.recipe",
}


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
    float8: Float8Section = field(default_factory=Float8Section)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    validation: ValidationSection = field(default_factory=ValidationSection)
    profiling: ProfilingSection = field(default_factory=ProfilingSection)
    retrofit: RetrofitSection = field(default_factory=RetrofitSection)  # used when retrofit.hf_path is set
    source: str | None = None  # the TOML file this came from

    @property
    def family(self) -> LoopLMFamily | RetrofitFamily:
        """The run's model family (titanloop.family) at the loop sampler's T, built from its own sections."""
        key = (repr(self.model), repr(self.retrofit), self.loop_sampler.n_loops)
        if getattr(self, "_family_key", None) != key:
            self._family, self._family_key = family_of(self.model, self.retrofit, self.loop_sampler.n_loops), key
        return self._family

    @property
    def looplm(self) -> LoopLMConfig:
        """The model's shape (its family's view: for a retrofit run, read from the HF checkpoint's config.json)."""
        return self.family.shape

    def engine_settings(self) -> EngineSettings:
        """All an engine (titanloop.train.engines) is given of this config."""
        t = self.training
        return EngineSettings(
            self.parallelism,
            self.optimizer,
            self.lr_scheduler,
            self.float8,
            steps=t.steps,
            micro_batch_size=t.micro_batch_size,
            max_norm=t.max_norm,
            forward_ad=self.objective.jsrr_weight > 0,
        )

    def to_dict(self) -> dict:
        """Plain, JSON-serializable view (what W&B receives as its config and checkpoints store; no secrets)."""
        d = {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}
        d["model"] = self.model.to_dict()
        d["validation"].pop("held_out", None)
        d["source"] = self.source
        return d


SECTIONS = [f.name for f in dataclasses.fields(TrainConfig) if f.name != "source"]


def parse_overrides(args: list[str]) -> dict[str, dict]:
    """["--training.steps", "10", "--data.kind=mds"] -> {"training": {"steps": 10}, "data": {"kind": "mds"}}."""
    return parse_section_overrides(args, SECTIONS)


def load_config(
    path: str | os.PathLike | None, overrides: list[str] | None = None, world_size: int | None = None
) -> TrainConfig:
    """Read a TOML file (None = all defaults), apply `--section.key value` overrides and validate.

    world_size (default: $WORLD_SIZE, else 1) is checked against the parallelism section here, so a bad
    mesh fails before torch.distributed is initialized.
    """
    raw: dict = read_toml(path) if path is not None else {}
    unknown = sorted(set(raw) - set(SECTIONS))
    if unknown:
        raise ConfigError(f"config has unknown section(s) {unknown}: allowed sections are {SECTIONS}")
    for section, values in parse_overrides(overrides or []).items():
        raw.setdefault(section, {}).update(values)
    for section, values in raw.items():
        if not isinstance(values, dict):
            raise ConfigError(f"config entry {section!r} must be a [section] table")
    refuse_moved(raw, MOVED)
    classes = typing.get_type_hints(TrainConfig)  # section name -> its dataclass
    sections = {name: build_section(name, classes[name], raw.get(name, {})) for name in SECTIONS}
    cfg = TrainConfig(**sections, source=str(path) if path is not None else None)
    cfg.validation.validate(cfg.data)
    validate_layout(cfg, int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size)
    return cfg


def validate_layout(cfg: TrainConfig, world_size: int) -> None:
    """Cross-section checks that need the world size: mesh, TP vs heads, batch divisibility, loops."""
    dp, tp = mesh_degrees(cfg.parallelism, world_size)
    p, o = cfg.parallelism, cfg.objective
    require(
        not (tp > 1 and p.engine == "deepspeed"),
        "parallelism.tp",
        tp,
        "1 with parallelism.engine='deepspeed' (ZeRO is data-parallel only; use engine='fsdp2' for tensor parallelism)",
    )
    require(
        not (p.engine == "deepspeed" and p.zero_stage == 3 and o.jsrr_weight > 0),
        "objective.jsrr_weight",
        o.jsrr_weight,
        "0 with ZeRO-3 (its parameter gathering has no forward-mode AD for JSRR's Jacobian-vector products; "
        "use parallelism.zero_stage=2 or engine='fsdp2')",
    )
    family = cfg.family
    check_float8_layout(cfg.float8, p.engine, tp, family.float8)
    m = family.shape
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
        not (tp > 1 and o.jsrr_weight > 0),
        "objective.jsrr_weight",
        o.jsrr_weight,
        "0 under tensor parallelism (the JSRR Jacobian-vector product runs on unsharded layers only)",
    )
    t = cfg.training
    if tp > 1 and p.sequence_parallel:
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
    loops = cfg.loop_sampler.bounds()
    check_depth_tools(cfg, family, tp)
    family.check_layout(tp=tp, engine=p.engine, objective=o.name, jsrr_weight=o.jsrr_weight, loops=loops)
    if cfg.validation.enable:
        check_validation_layout(cfg, m)
    if o.name == "stage2_gate":
        require(loops[0] >= 2, "loop_sampler", loops[0], ">= 2 loops per step for objective.name='stage2_gate'")


def check_depth_tools(cfg: TrainConfig, family, tp: int) -> None:
    """What truncated backpropagation through depth, the random initial state and the diagonal injection need."""
    s, m = cfg.loop_sampler, family.shape
    if s.backprop_loops:
        require(
            family.name == "looplm",
            "loop_sampler.backprop_loops",
            s.backprop_loops,
            "0 for a retrofit run (truncated backpropagation through depth is a LoopLM option)",
        )
        require(
            not s.truncates or m.inject_embedding,
            "loop_sampler.backprop_loops",
            s.backprop_loops,
            "0 unless model.inject_embedding = true (with truncation the embedding reaches the loss only through the "
            "injection into the loops with a graph)",
        )
        require(
            cfg.objective.name != "stage2_gate" or s.backprop_loops >= 2,
            "loop_sampler.backprop_loops",
            s.backprop_loops,
            "0 or >= 2 for objective.name='stage2_gate' (its gate loss compares consecutive loops with a graph)",
        )
    if cfg.objective.fixed_point_weight > 0:
        require(
            family.name == "looplm" and not m.per_loop_norm,
            "objective.fixed_point_weight",
            cfg.objective.fixed_point_weight,
            "0 unless the model is a LoopLM with model.per_loop_norm = false (the penalty runs one loop past the last "
            "with the map every loop shares)",
        )
        require(
            cfg.objective.name != "stage2_gate",
            "objective.fixed_point_weight",
            cfg.objective.fixed_point_weight,
            "0 with objective.name = 'stage2_gate' (Stage II trains the exit gate only)",
        )
        require(
            tp == 1,
            "objective.fixed_point_weight",
            cfg.objective.fixed_point_weight,
            "0 under tensor parallelism (parallelism.tp > 1): its per-token change is not gathered across shards",
        )
    if tp > 1:
        for key, value, default in (("init_state", m.init_state, "embedding"), ("injection", m.injection, "add")):
            require(
                value == default, f"model.{key}", value, f"{default!r} under tensor parallelism (parallelism.tp > 1)"
            )


def check_validation_layout(cfg: TrainConfig, m: LoopLMConfig) -> None:
    v = cfg.validation
    require(
        cfg.family.reads_out_every_loop,
        "validation.enable",
        True,
        "false for a retrofit run (validation "
        "scores LoopLM readouts at every loop; a retrofit model decodes its last recurrence step only)",
    )
    if m.per_loop_norm:
        require(
            max(v.loop_counts(cfg.loop_sampler.n_loops, m)) <= m.max_loops,
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
