"""The training loop of a LoopLM. `train(run, callbacks)` is the whole loop; `train_step` is one optimizer step.

One step: T loops from the LoopSampler (a function of the step only, the same on every rank); for each
micro-batch of the step (gradient accumulation; the batch-size ramp may change their number per step): forward
T loops, the per-loop objective on the full sequence (titanloop.objectives.objective), backward through the engine
(titanloop.train.engines); one all-reduce of [loss, per-loop statistics] (the statistics only on steps that log
them: step 1, every metrics.log_freq steps, validation steps); one device-to-host read of the reduced values and
the gradient norm; then the callbacks may veto the optimizer step (a non-finite loss on any rank skips it on every
rank); clip, optimizer step, LR step (a non-finite gradient norm skips those two and is handled like a non-finite
loss). Both checks run on every step.
Everything else (metrics, checkpoints, preemption, ...) is a callback (titanloop.train.callbacks).
"""

from __future__ import annotations

import json
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from titanloop.model.attention import document_lengths
from titanloop.objectives import jsrr_probes, jsrr_target, loop_objective
from titanloop.parallel import count_collectives, gather_sequence
from titanloop.parallel.float8 import count_weight_casts
from titanloop.parallel.grad_norm import nonfinite_grad_names
from titanloop.train.callbacks import Callback, StepResult
from titanloop.train.startup import Mesh, Run
from titanloop.train.step_timer import StepTimer, profile_line, profile_record


def train(run: Run, callbacks: list[Callback]) -> int:
    """Train until training.steps or until a callback stops the run; returns the exit code (0, 3 or 75)."""
    state = run.state
    started = time.perf_counter()
    for cb in callbacks:
        cb.pre_train(run)  # Checkpointing resumes every state from the run dir here
    batches = iter(run.dataloader)  # from the restored data position
    run.startup["pre_train"] = time.perf_counter() - started  # resume, the loader's first batches queued
    if run.cfg.metrics.step_profile and run.mesh.rank == 0:  # start-up, before the first step's own line
        print(startup_line(run.startup), flush=True)
        with open(Path(run.cfg.training.run_dir) / "step_profile.jsonl", "a") as f:
            f.write(json.dumps({"startup": run.startup}) + "\n")
    while state.step < run.cfg.training.steps and state.exit_code is None:
        state.step += 1
        timer = StepTimer.for_step(run, state.step)  # log steps: breakdown and whole-step profile
        start = time.perf_counter()
        _call_hooks(timer, "pre_step", callbacks, lambda cb: cb.pre_step(run))
        result = train_step(run, batches, callbacks, timer=timer)
        state.ntokens_seen += result.tokens  # global: the same count at any world size
        # metrics, checkpoint, preemption, non-finite stop
        _call_hooks(timer, "post_step", callbacks, lambda cb: cb.post_step(run, result))
        if timer.profile:
            write_profile(run, profile_record(state.step, time.perf_counter() - start, timer.parts))
    return state.exit_code or 0


def _call_hooks(timer: StepTimer, hook: str, callbacks: list[Callback], call: Callable[[Callback], None]) -> None:
    """`call` on every callback; on profiled steps each callback's time is its own part (hook/<Name>)."""
    if not timer.profile:
        for cb in callbacks:
            call(cb)
        return
    with timer.part(hook):
        for cb in callbacks:
            with timer.part(f"{hook}/{type(cb).__name__}"):
                call(cb)


def startup_line(startup: dict) -> str:
    """The start-up parts before the first step, in seconds (None: not measurable here)."""
    parts = " | ".join(f"{k} {'n/a' if v is None else f'{v:.2f}'}" for k, v in startup.items())
    return f"[titanloop] start-up (s): {parts} (then step 1: its profile line)"


def write_profile(run: Run, record: dict) -> None:
    """Rank 0: the profile line on stdout and one row of <run_dir>/step_profile.jsonl."""
    if run.mesh.rank != 0:
        return
    print(profile_line(record), flush=True)
    with open(Path(run.cfg.training.run_dir) / "step_profile.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


def logs_statistics(cfg, step: int) -> bool:
    """Whether step `step` writes a metrics line (step 1, every metrics.log_freq steps, validation steps): only
    those steps compute, reduce and read back the per-loop statistics; every step reduces the loss."""
    v = cfg.validation
    return (
        step == 1
        or step % cfg.metrics.log_freq == 0
        or (v.enable and (step % v.freq == 0 or step == cfg.training.steps))
    )


def train_step(run: Run, batches, callbacks: list[Callback], timer: StepTimer | None = None) -> StepResult:
    """Forward/backward over the step's micro-batches, the all-reduced loss, then (unless a callback vetoes it)
    clip + optimizer + LR step.

    One device-to-host read per step: the reduced loss (with the statistics on log steps) and, on the FSDP2 engine,
    the gradient norm come back together, so a non-finite loss or gradient is caught on every step at the cost of
    the one read the optimizer's finiteness check needs anyway (as a gradient scaler does)."""
    cfg, engine, state = run.cfg, run.engine, run.state
    timer = timer or StepTimer.for_step(run, state.step)  # phase times on log steps only
    start = time.perf_counter()
    count_casts = cfg.metrics.count_comms and cfg.float8.recipe != "off"  # logged as comm/float8_weight_cast
    with (
        count_collectives() if cfg.metrics.count_comms else nullcontext() as comms,
        count_weight_casts() if count_casts else nullcontext() as casts,
    ):
        n_loops = run.loop_sampler(state.step)
        accum = run.dataloader.grad_accum_at(state.step - 1)
        lr = engine.lr()
        statistics = logs_statistics(cfg, state.step)
        acc = accumulate_gradients(run, batches, n_loops, accum, timer=timer, statistics=statistics)
        norm_first = hasattr(engine, "grad_norm")  # FSDP2: the norm joins the one host read
        with timer.phase("allreduce"):
            with timer.part("grad_norm"):
                norm_t = engine.grad_norm() if norm_first else None
            with timer.part("allreduce"):
                loss, per_loop, norm = mean_over_ranks(acc.loss_sum, acc.stats_sum, run.mesh, norm_t)
        result = StepResult(state.step, n_loops, loss, per_loop, lr, doc_lengths=acc.doc_lengths, tokens=acc.tokens)
        with timer.part("pre_optim"):
            take = all([cb.pre_optim_step(run, result) for cb in callbacks])  # (every callback sees every step)
        if take:
            with timer.phase("optimizer"):
                if norm_first:
                    engine.step(max_norm(cfg), grad_norm=norm_t, norm_value=norm, part=timer.part)
                    grad_norm = norm
                else:
                    with timer.part("optimizer"):
                        grad_norm = float(engine.step(max_norm(cfg)))  # non-finite: no optimizer/LR step taken
            if math.isfinite(grad_norm):
                result.grad_norm = grad_norm
            else:
                result.nonfinite_grad_norm = grad_norm
                result.nonfinite_grads = list(engine.nonfinite_grads)
        else:  # a non-finite loss: the gradients are unclipped
            result.nonfinite_grads = nonfinite_grad_names(engine.model)
        if result.skipped:
            with timer.part("zero_grad"):
                engine.zero_grad()
    result.seconds = time.perf_counter() - start
    with timer.part("wait"):  # the breakdown's all-gather of every rank's times waits for the slowest rank
        result.timings = timer.finish(result.seconds)
    result.comms = {**(comms or {}), **(casts or {})}
    return result


def max_norm(cfg) -> float:
    """The clipping bound engine.step takes (training.max_norm; 0 = measure the norm only)."""
    return cfg.training.max_norm if cfg.training.max_norm > 0 else float("inf")


@dataclass
class Accumulated:
    """What the micro-batches of one step leave behind besides their gradients (this rank's values)."""

    loss_sum: torch.Tensor  # mean over micro-batches of the loss
    stats_sum: dict  # mean over micro-batches of each per-loop statistic
    doc_lengths: list  # packed documents of this rank's micro-batches (MFU counts the keys they attend to)
    tokens: int  # tokens of the step over all data-parallel ranks


def accumulate_gradients(
    run: Run,
    batches,
    n_loops: int,
    accum: int,
    before_micro_batch: Callable[[], None] | None = None,
    timer: StepTimer | None = None,
    statistics: bool = True,
) -> Accumulated:
    """The gradient-accumulation part of a step, shared by the trainer (train_step) and the memory plan: zero the
    gradients, then forward T loops + objective and backward for each of `accum` micro-batches from `batches`
    (gradients synchronized after the last one). `before_micro_batch` is a hook for the memory tracker.
    statistics=False: the objective returns no per-loop statistics (steps that log none)."""
    engine = run.engine
    timer = timer or StepTimer(False)  # the memory plan times nothing
    with timer.part("zero_grad"):
        engine.zero_grad()
    loss_sum, stats_sum = torch.zeros((), device=run.mesh.device), None
    doc_lengths, tokens = [], 0
    for i in range(accum):
        if before_micro_batch is not None:
            before_micro_batch()
        with timer.phase("data"), timer.part("data"):
            batch = next(batches)
        if run.cfg.training.doc_masking:
            doc_lengths += document_lengths(batch["doc_ids"])  # a CPU tensor: no device sync
        tokens += batch["labels"].numel() * run.mesh.dp_world
        with timer.phase("forward"):
            loss, stats = forward_objective(run, batch, n_loops, timer=timer, statistics=statistics)
        with timer.phase("backward"), timer.part("backward"):
            engine.backward(loss * (1.0 / accum), last_micro_batch=(i == accum - 1))
        with timer.part("statistics"):
            loss_sum += loss.detach() / accum
            stats = {k: v / accum for k, v in stats.items()}
            stats_sum = stats if stats_sum is None else {k: stats_sum[k] + v for k, v in stats.items()}
        del loss
    return Accumulated(loss_sum, stats_sum, doc_lengths, tokens)


def forward_objective(
    run: Run, batch: dict, n_loops: int, timer: StepTimer | None = None, statistics: bool = True
) -> tuple[torch.Tensor, dict]:
    """One micro-batch (a dict of CPU tensors from titanloop.data): forward T loops, then the objective on the
    full sequence (gathered from the tp ranks under sequence parallelism). Returns (loss, statistics); the
    statistics are {} unless `statistics`."""
    cfg, mesh = run.cfg, run.mesh
    timer = timer or StepTimer(False)
    # pinned on CUDA (the loader's prefetch thread): the copies are asynchronous; the document ids stay on the host,
    # where the model reads the document boundaries without waiting for the GPU
    with timer.part("h2d"):
        input_ids = batch["input_ids"].to(mesh.device, non_blocking=True)
        labels = batch["labels"].to(mesh.device, non_blocking=True)
    doc_ids = batch["doc_ids"] if cfg.training.doc_masking else None

    # truncated backpropagation through depth: the objective sees the last k loops, those with a graph
    backprop = cfg.loop_sampler.backprop_loops
    init_seed = initial_state_seed(cfg.training.seed, batch) if cfg.looplm.init_state == "random" else None

    # the fixed-point penalty: loop T + 1 runs inside the forward (LoopLM.loop_change)
    extra = {"loop_change": True} if cfg.objective.fixed_point_weight > 0 else {}

    def forward_and_objective(model):
        with timer.part("model"):
            if backprop or init_seed is not None:
                out = model(input_ids, n_loops, doc_ids=doc_ids, backprop_loops=backprop, init_seed=init_seed, **extra)
            else:
                out = model(input_ids, n_loops, doc_ids=doc_ids, **extra)
        with timer.part("objective"):
            return objective(model, out)

    def objective(model, out):
        readouts = [gather_sequence(r, mesh.sp_mesh) for r in out.readouts]
        states = [gather_sequence(s, mesh.sp_mesh) for s in out.states]
        gates = gather_sequence(out.gate_logits, mesh.sp_mesh, seq_dim=2)
        jsrr_map = jsrr_state = probes = None
        if cfg.objective.jsrr_weight > 0:
            jsrr_map, jsrr_state = jsrr_target(model, out, input_ids, doc_ids, n_loops)
            # one direction per sample, from (seed, global sample index): each rank probes its own samples, and a
            # resumed run (any world size) draws the same directions
            probes = jsrr_probes(jsrr_state.shape, batch["sample_ids"], cfg.training.seed + 1)
        return loop_objective(
            cfg.objective,
            readouts,
            states,
            gates,
            labels,
            model.lm_head.weight,
            jsrr_map,
            jsrr_state,
            probes,
            statistics=statistics,
            loop_change=out.loop_change,  # tp == 1 (check_depth_tools): the whole sequence
        )

    return run.engine.forward(forward_and_objective)


def initial_state_seed(seed: int, batch: dict) -> int:
    """The seed of a micro-batch's random initial state (model.init_state='random'): a function of the run's seed
    and the micro-batch's first global sample index, so a resumed run draws the same states."""
    ids = batch.get("sample_ids")
    first = int(ids.reshape(-1)[0]) if ids is not None and ids.numel() else 0
    return (seed * 0x9E3779B97F4A7C15 + first * 0xBF58476D1CE4E5B9 + 0x5851F42D4C957F2D) % (1 << 63)


def mean_over_ranks(
    loss_sum: torch.Tensor, stats_sum: dict, mesh: Mesh, grad_norm: torch.Tensor | None = None
) -> tuple[float, dict, float | None]:
    """One all-reduce carries the loss and every statistic; tp replicas hold equal values, so the world mean is
    the mean over data-parallel ranks. A NaN/Inf on any rank makes the reduced loss non-finite on every rank.
    `grad_norm` (already reduced) comes back in the same device-to-host read. Returns (loss, statistics, norm)."""
    keys = sorted(stats_sum)
    if keys:
        packed = torch.cat([loss_sum.view(1)] + [stats_sum[k].reshape(-1).float() for k in keys]).to(mesh.device)
    else:  # a step that logs nothing: the loss alone
        packed = loss_sum.reshape(1).to(mesh.device)
    dist.all_reduce(packed)
    packed = packed / mesh.world_size
    if grad_norm is not None:  # float64: any norm dtype and the float32 loss/statistics come back exactly
        host = torch.cat([packed.double(), grad_norm.reshape(1).double()]).cpu()
        norm = float(host[-1])
    else:
        host, norm = packed.cpu(), None
    per_loop, offset = {}, 1
    for k in keys:
        n = stats_sum[k].numel()
        per_loop[k] = host[offset : offset + n].tolist()
        offset += n
    return float(host[0]), per_loop, norm
