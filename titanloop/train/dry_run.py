"""`python -m titanloop.train --config C --dry-run --world-size N [--memory-plan | --fit-ac] [--gpu-mem-gb G]`

Starts a training run at its real world size in one process, without GPUs: torchtitan's
`comm.mode = "fake_backend"` gives a fake process group in which this process plays rank 0 of N (collectives
return at once, nothing is sent). Then the trainer's own startup steps run as in a real start: config checks
at world size N, ParallelDims and the device mesh, the model built on the meta device, parallelized with
FSDP2 + TP + AC + compile as configured (bf16 parameters, as on GPU), the optimizer, the LR / loop-count /
batch schedules over the stage's whole length, the checkpoint plan and the data plan. Nothing is allocated
(meta tensors), no file is written. Exit 0 with a summary, or 2 with a one-line reason.

`--memory-plan` adds the per-GPU memory plan (titanloop.train.memory_plan), judged against this machine's GPU
memory where it has a CUDA device, else against --gpu-mem-gb (default 80, the H100 the stage configs target).
`--fit-ac` plans the config at several activation-checkpointing settings and names the least recomputation whose
plan fits (`fit_activation_checkpointing`), as torchtitan's memory estimator plans a configuration on fake tensors
to find what fits before a job is launched.
"""

from __future__ import annotations

import math
import os
import re
import shlex
import sys
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titanloop.checkpoint import CheckpointConfig, layout
from titanloop.config_errors import ConfigError, cli_errors, require
from titanloop.data.loader import micro_batches_per_rank
from titanloop.data.shards import is_remote
from titanloop.objectives import LoopSampler
from titanloop.parallel.activation_checkpoint import describe as describe_ac
from titanloop.parallel.float8 import float8_summary
from titanloop.recipe import stages
from titanloop.train.config import TrainConfig, load_config, validate_layout
from titanloop.train.engines.config import mesh_degrees
from titanloop.train.engines import build_lr_schedulers, build_optimizer, parallelize
from titanloop.train.memory_plan import GB, MemoryPlan, gpu_memory_gb, plan_memory
from titanloop.train.startup import build_model, default_comm, init_mesh, param_dtype
from titanloop.train.validation import batch_size, held_out_batches

# Tensors printed in the per-rank shapes table (the largest and one of each kind of projection).
_SHAPE_KEYS = (
    "embed_tokens.weight",
    "layers.0.self_attn.q_proj.weight",
    "layers.0.self_attn.k_proj.weight",
    "layers.0.mlp.down_proj.weight",
    "lm_head.weight",
)


def slurm_stages(repo: Path, retrofit: bool = True) -> list[tuple[str, str, int, list[str]]]:
    """(script name, stage config, world size, overrides) of every slurm/*.sh stage script, at its
    `#SBATCH --nodes` x `--gres=gpu:N` (the size it asks for), with the overrides the script itself passes
    (`set -- --section.key value ... "$@"`, e.g. the DeepSpeed engine settings). retrofit=False leaves out
    retrofit runs (a [retrofit] section: their shape comes from a user's pretrained checkpoint)."""
    out = []
    for script in sorted((Path(repo) / "slurm").glob("*.sh")):
        text = script.read_text()
        config = re.search(r"^STAGE_CONFIG=(\S+)", text, re.M)
        if config is None:  # common.sh, launch_node.sh, local_cluster.sh
            continue
        if not retrofit and "[retrofit]" in (Path(repo) / config.group(1)).read_text():
            continue
        nodes = re.search(r"^#SBATCH --nodes=(\d+)", text, re.M)
        gpus = re.search(r"^#SBATCH --gres=gpu:(\d+)", text, re.M)
        require(nodes is not None and gpus is not None, str(script), "?", "#SBATCH --nodes=N and --gres=gpu:G lines")
        fixed = re.search(r'^set -- (.*?)"\$@"', text.replace("\\\n", " "), re.M)
        overrides = shlex.split(fixed.group(1)) if fixed else []
        out.append((script.name, config.group(1), int(nodes.group(1)) * int(gpus.group(1)), overrides))
    return out


@contextmanager
def fake_mesh(cfg: TrainConfig, world_size: int, rank: int = 0):
    """The trainer's init_mesh on torchtitan's fake backend (comm.mode="fake_backend"): this process is `rank` of
    `world_size`. The process group is destroyed on exit, so several dry runs can share one process."""
    saved = {k: os.environ.get(k) for k in ("NGPU", "RANK", "LOCAL_RANK")}
    os.environ.update(NGPU=str(world_size), RANK=str(rank), LOCAL_RANK="0")
    comm = default_comm()
    comm.mode = "fake_backend"
    try:
        yield init_mesh(cfg, comm)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@dataclass
class DryRunReport:
    lines: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    memory_plan: object | None = None

    def add(self, line: str) -> None:
        self.lines.append(line)

    def text(self) -> str:
        return "\n".join(self.lines + [f"warning: {w}" for w in self.warnings])


def _shape_table(model, report: DryRunReport) -> None:
    params = dict(model.named_parameters())
    for key in _SHAPE_KEYS:
        p = params.get(key)
        if p is None:
            continue
        local = tuple(p.to_local().shape) if isinstance(p, DTensor) else tuple(p.shape)
        where = f" {tuple(p.placements)}" if isinstance(p, DTensor) else ""
        report.add(f"  {key}: global {tuple(p.shape)} -> rank 0 {local}{where} {p.dtype}")


def _schedules(cfg: TrainConfig, lr_schedulers, dp: int, report: DryRunReport) -> None:
    """Walk the LR, loop-count and batch schedules over every step of the stage."""
    t = cfg.training
    lam = lr_schedulers.schedulers[0].lr_lambdas[0]
    sampler = LoopSampler(cfg.loop_sampler, t.steps)
    ramp = t.batch_ramp()
    lrs, loops, accums, tokens = [], set(), set(), 0
    for step in range(t.steps):
        factor = lam(step)
        require(
            math.isfinite(factor) and factor >= 0, "lr_scheduler", factor, f"a finite LR factor >= 0 at step {step}"
        )
        if step in (0, cfg.lr_scheduler.warmup_steps, t.steps - 1):
            lrs.append((step, factor * cfg.optimizer.lr))
        if cfg.loop_sampler.kind != "fixed" or step == 0:
            loops.add(sampler(step))
        batch = ramp.batch_at(step) if ramp else t.global_batch_size
        accums.add(micro_batches_per_rank(batch, t.micro_batch_size, dp))  # the trainer's count (and check)
        tokens += batch * t.seq_len
    report.add(
        "schedules over all "
        + f"{t.steps:,} steps: LR "
        + ", ".join(f"{lr:.3g} at step {s}" for s, lr in lrs)
        + f" | loops T in {sorted(loops) if len(loops) < 6 else (min(loops), max(loops))}"
        f" | grad accum {min(accums)}..{max(accums)} micro-batches of {t.micro_batch_size} x {t.seq_len}"
        f" | {tokens / 1e12:.3f}T tokens"
    )


def _data_plan(cfg: TrainConfig, dp: int, report: DryRunReport) -> None:
    data = cfg.data
    t = cfg.training
    line = (
        f"data: {data.kind}, each of {dp} data-parallel ranks reads {t.micro_batch_size} x {t.seq_len} "
        f"tokens per micro-batch"
    )
    if data.sources:
        total = sum(s.weight for s in data.sources)
        line += "; sources " + ", ".join(f"{s.path} ({s.weight / total:.1%})" for s in data.sources)
        missing = [s.path for s in data.sources if not is_remote(s.path) and not Path(s.path).exists()]
        placeholders = [s.path for s in data.sources if "YOUR-BUCKET" in s.path]
        if missing:
            report.warnings.append(f"data sources not found here (fine if they exist on the cluster): {missing}")
        if placeholders:
            report.warnings.append(
                f"{len(placeholders)} data source(s) are placeholders (YOUR-BUCKET): point "
                "[data] sources at your shard sets"
            )
    report.add(line)


def _validation_plan(cfg: TrainConfig, dp: int, report: DryRunReport) -> None:
    """What validation reads and scores; the held-out reader is built here for rank 0 where its data is local."""
    v, t = cfg.validation, cfg.training
    if not v.enable:
        report.add("validation: off")
        return
    d, b = v.held_out, batch_size(cfg)
    runs = t.steps // v.freq + (t.steps % v.freq != 0)
    loops = v.loop_counts(cfg.loop_sampler.n_loops, cfg.looplm)
    size = (
        f"the whole held-out set in batches of {b} rows (validation.steps = 0)"
        if v.steps == 0
        else f"{v.steps} batches x {b} rows per data-parallel rank ({v.steps * b * dp} held-out rows)"
    )
    line = (
        f"validation: {runs} runs (every {v.freq} steps and the last), {size}, loops T in {loops}, "
        f"Q-exit q in {v.q}, held-out data {d.kind}"
    )
    if d.kind in ("synthetic_task", "synthetic_text"):
        batches = held_out_batches(cfg, 0, dp)  # the reader rank 0 builds at the start of training
        scored = sum(int((x["labels"] != -100).sum()) for x in batches)
        line += f" ({d.task}, split {d.split})" if d.kind == "synthetic_task" else f" (seed {d.seed})"
        line += f"; rank 0 reader built: {len(batches)} batches, {scored:,} scored tokens"
    else:
        line += "; sources " + ", ".join(s.path for s in d.sources)
        missing = [s.path for s in d.sources if not is_remote(s.path) and not Path(s.path).exists()]
        placeholders = [s.path for s in d.sources if "YOUR-BUCKET" in s.path]
        if missing:
            report.warnings.append(f"validation sources not found here (fine if they exist on the cluster): {missing}")
        if placeholders:
            report.warnings.append(
                f"{len(placeholders)} validation source(s) are placeholders (YOUR-BUCKET): point "
                "[validation.data] sources at your held-out shard sets"
            )
    report.add(line)


def validation_memory_note(cfg: TrainConfig, activations: int, dtype_bytes: int = 2) -> str:
    """Validation's memory next to the plan's training step (not measured, counted from the shapes): a no-grad
    forward between steps, compared with the step's measured activations (`activations`, bytes)."""
    m, t = cfg.looplm, cfg.training
    t_max = max(max(cfg.validation.loop_counts(cfg.loop_sampler.n_loops, m)), cfg.loop_sampler.n_loops)
    held = 2 * t_max * batch_size(cfg) * t.seq_len * m.hidden_size * dtype_bytes
    verdict = (
        "below the step's activations, so no new peak"
        if held < activations
        else "MORE than the step's activations: lower validation.batch_size or validation.loops"
    )
    return (
        f"validation (counted, not measured): runs between steps, no backward; its forward to T={t_max} loops "
        f"holds {t_max} readouts + {t_max} states [{batch_size(cfg)}, {t.seq_len}, {m.hidden_size}] = "
        f"{held / 1e9:.2f} GB (+ one CE chunk), {verdict} ({activations / 1e9:.2f} GB)"
    )


def _checkpoint_plan(cfg: TrainConfig, n_params: int, n_trainable: int, world_size: int, report: DryRunReport) -> None:
    c, t = cfg.checkpoint, cfg.training
    # fp32 weights + two fp32 Adam moments of the trained ones (DCP writes each rank's shards; frozen parameters,
    # e.g. stage II's LM or a retrofit's base, get no gradient and so no optimizer state)
    size = n_params * 4 + n_trainable * 8
    if c.enable:
        saves = t.steps // c.interval + (t.steps % c.interval != 0)
        report.add(
            f"checkpoints: {saves} saves to {t.run_dir}/{CheckpointConfig.folder} (every {c.interval} steps, "
            f"keep {c.keep_latest_k}), ~{size / 1e9:.1f} GB each, ~{size / world_size / 1e9:.2f} GB per rank"
        )
    else:
        report.add("checkpoints: disabled")
    root = Path(t.run_dir) / CheckpointConfig.folder
    if c.enable and layout.latest_step(root) is not None:
        report.add(f"  resumes from {root} step {layout.latest_step(root)}")
    elif cfg.stage.init_from:
        found = stages.checkpoint_folder(cfg.stage.init_from) if Path(cfg.stage.init_from).exists() else None
        report.add(
            f"  starts from the previous stage {cfg.stage.init_from}"
            + (f" step {found[1]}" if found else " (not present here)")
            + (f", upcycled ({cfg.stage.upcycle})" if cfg.stage.upcycle != "none" else "")
        )
        if not found:
            report.warnings.append(
                f"stage.init_from={cfg.stage.init_from!r} has no checkpoint here: the real "
                "start needs the previous stage's checkpoints there"
            )


def plan_of(
    cfg: TrainConfig,
    world_size: int,
    *,
    gpu_mem_gb: float | None = None,
    progress: Callable[[str], None] | None = None,
) -> MemoryPlan:
    """The memory plan of `cfg` for rank 0 of `world_size` ranks, on the fake process group and meta tensors: what
    `--dry-run --memory-plan` plans, without the rest of the dry run. Judged against `gpu_mem_gb`, by default this
    machine's GPU or 80 GB (memory_plan.gpu_memory_gb); its notes say which, and the validation pass's memory."""
    validate_layout(cfg, world_size)
    gpu_gb, source = gpu_memory_gb(gpu_mem_gb)
    with fake_mesh(cfg, world_size) as mesh:
        plan = plan_memory(cfg, mesh, gpu_mem_gb=gpu_gb, progress=progress)
    plan.notes.append(f"GPU memory {gpu_gb:.1f} GB ({source})")
    if cfg.validation.enable:
        dtype = param_dtype(cfg, "cuda")
        plan.notes.append(validation_memory_note(cfg, plan.rows.get("activations", 0), dtype.itemsize))
    return plan


def planned_peak_bytes(config_path: str | Path, args: list[str], world_size: int) -> int:
    """The memory plan's peak per rank, in bytes, of `config_path` + command-line `args` at `world_size` ranks,
    not judged against any GPU's memory."""
    return plan_of(load_config(config_path, args, world_size=world_size), world_size, gpu_mem_gb=1e6).peak


def dry_run(
    cfg: TrainConfig,
    world_size: int,
    *,
    memory_plan: bool = False,
    gpu_mem_gb: float | None = None,
    progress: Callable[[str], None] | None = None,
) -> DryRunReport:
    """Everything a real start at `world_size` does, on a fake process group and meta tensors. `progress` gets the
    memory plan's progress lines (the CLI prints them to stderr; the report itself is returned whole). The plan is
    judged against `gpu_mem_gb`, by default this machine's GPU or 80 GB (memory_plan.gpu_memory_gb)."""
    validate_layout(cfg, world_size)
    dp, tp = mesh_degrees(cfg.parallelism, world_size)
    report = DryRunReport()
    with fake_mesh(cfg, world_size) as mesh:
        model = build_model(cfg, load_weights=False)  # meta
        unique = {id(p): p for p in model.parameters()}.values()
        n_params, n_trainable = sum(p.numel() for p in unique), sum(p.numel() for p in unique if p.requires_grad)
        dtype = param_dtype(cfg, "cuda")  # what the run gets on the GPUs it is meant for
        model = parallelize(
            cfg.engine_settings(), model, mesh, dtype, device_type="cuda"
        )  # float8 (if on) as on GPUs: not emulated
        optimizers = build_optimizer(cfg.optimizer, model, tp, "cuda")  # as on the GPUs
        lr_schedulers = build_lr_schedulers(cfg.lr_scheduler, cfg.training.steps, optimizers)
        m = cfg.looplm
        ac = describe_ac(cfg.parallelism.activation_checkpoint, cfg.parallelism.ac_kept_loops)
        report.add(
            f"{cfg.source or 'config'} at world size {world_size}: mesh dp_shard {dp} x tp {tp} "
            f"(fake backend, rank 0 of {world_size})"
        )
        what = cfg.family.describe()
        report.add(
            f"{what}: {n_params / 1e9:.3f}B parameters, {m.n_layers} looped layers x "
            f"hidden {m.hidden_size}, built on meta, FSDP2{' + TP' if tp > 1 else ''}, AC "
            f"{ac}, compile {cfg.parallelism.compile}, {dtype} "
            f"compute; optimizer {cfg.optimizer.name} over {sum(1 for _ in model.parameters())} tensors"
        )
        if cfg.float8.recipe != "off":
            report.add(float8_summary(model, cfg.float8.recipe))
        if cfg.parallelism.engine != "fsdp2":
            report.warnings.append(
                f"parallelism.engine={cfg.parallelism.engine!r}: its settings and the schedules are "
                "checked, but the mesh and per-rank shapes shown are FSDP2's (ZeRO partitions its "
                "own way) and --memory-plan is refused"
            )
        report.add("per-rank shapes:")
        _shape_table(model, report)
        _schedules(cfg, lr_schedulers, dp, report)
        _checkpoint_plan(cfg, n_params, n_trainable, world_size, report)
        _data_plan(cfg, dp, report)
        _validation_plan(cfg, dp, report)
    if memory_plan:
        report.memory_plan = plan_of(cfg, world_size, gpu_mem_gb=gpu_mem_gb, progress=progress)
        report.add(report.memory_plan.text())
    return report


def _kept(k: int, n_loops: int) -> list[str]:
    """The overrides that keep the first k of n_loops loops unrecomputed (k = n_loops: no activation checkpointing)."""
    mode = "none" if k >= n_loops else "loop"
    return ["--parallelism.activation_checkpoint", mode, "--parallelism.ac_kept_loops", str(0 if k >= n_loops else k)]


def largest_fitting(n_loops: int, fits: Callable[[int], bool]) -> int | None:
    """The largest k in 0..n_loops with fits(k), by bisection (fits holds up to some k, then not: every kept loop
    holds one more loop's activations); None when fits(0) does not hold."""
    lo, hi = -1, n_loops + 1  # fits(lo) holds (or lo = -1), fits(hi) does not (or hi = n_loops + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo if lo >= 0 else None


def fit_activation_checkpointing(
    config_path: str,
    overrides: list[str],
    world_size: int,
    *,
    gpu_mem_gb: float,
    margin: float = 0.0,
    progress: Callable[[str], None] = print,
) -> tuple[list[str] | None, list[dict]]:
    """The least recomputation whose memory plan fits `gpu_mem_gb` with the plan's reserve and `margin` x its peak
    kept free: no AC (every loop kept), else selective AC (saves the matmul and attention outputs: recomputes no
    matmul), else per-loop AC keeping the most loops that fit (`parallelism.ac_kept_loops`, by bisection: ceil(log2(T
    + 2)) plans). Returns the overrides chosen (None: nothing fits) and every plan made ({overrides, peak_gb, fits})."""
    n_loops = load_config(config_path, overrides, world_size=world_size).loop_sampler.bounds()[1]
    plans: list[dict] = []

    def fits(extra: list[str]) -> bool:
        cfg = load_config(config_path, [*overrides, *extra], world_size=world_size)
        plan = plan_of(cfg, world_size, gpu_mem_gb=gpu_mem_gb)
        need = plan.peak * (1 + margin) / GB + plan.reserve_gb
        plans.append({"overrides": extra, "peak_gb": plan.peak / GB, "fits": need <= gpu_mem_gb})
        what = describe_ac(cfg.parallelism.activation_checkpoint, cfg.parallelism.ac_kept_loops)
        progress(f"  AC {what}: peak {plan.peak / GB:.2f} GB, {need:.2f} GB with reserve and margin: " + (
            "fits" if plans[-1]["fits"] else "does NOT fit"))  # fmt: skip
        return plans[-1]["fits"]

    best = largest_fitting(n_loops, lambda k: fits(_kept(k, n_loops)))
    if best == n_loops:
        return _kept(best, n_loops), plans
    selective = ["--parallelism.activation_checkpoint", "selective", "--parallelism.ac_kept_loops", "0"]
    if fits(selective):
        return selective, plans
    return (None if best is None else _kept(best, n_loops)), plans


@cli_errors
def main(
    config_path: str,
    overrides: list[str],
    world_size: int,
    memory_plan: bool,
    gpu_mem_gb: float | None,
    fit_ac: bool = False,
    fit_margin: float = 0.0,
) -> int:
    cfg = load_config(config_path, overrides, world_size=world_size)
    if fit_ac:
        require(0 <= fit_margin < 1, "--fit-margin", fit_margin, "a fraction of the planned peak in [0, 1), e.g. 0.1")
        gpu_gb, source = gpu_memory_gb(gpu_mem_gb)
        print(f"{config_path} at world size {world_size}: the least recomputation that fits {gpu_gb:.1f} GB per GPU "
              f"({source}), margin {fit_margin:g}", flush=True)  # fmt: skip
        choice, _ = fit_activation_checkpointing(
            config_path, overrides, world_size, gpu_mem_gb=gpu_gb, margin=fit_margin,
            progress=lambda line: print(line, flush=True),
        )  # fmt: skip
        if choice is None:
            raise ConfigError(
                f"not even per-loop AC without kept loops fits {gpu_gb:.1f} GB per GPU at world size {world_size}: "
                "fewer sequences per micro-batch (training.micro_batch_size) or more GPUs"
            )
        print(f"least recomputation that fits: {' '.join(choice)}")
        return 0
    report = dry_run(
        cfg,
        world_size,
        memory_plan=memory_plan,
        gpu_mem_gb=gpu_mem_gb,
        progress=lambda line: print(line, file=sys.stderr, flush=True),
    )
    print(report.text())
    if report.memory_plan is not None and not report.memory_plan.fits:
        print(f"error: {report.memory_plan.verdict}", file=sys.stderr)
        return 2
    print(f"dry run ok: {config_path} starts at world size {world_size}")
    return 0
