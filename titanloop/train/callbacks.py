"""Side concerns of the training loop as callbacks with named hooks (in the way OLMo-core's trainer has them).

The loop (titanloop.train.loop.train) calls, on every callback in order:

    pre_train(run)                    once, before the first step (resume happens here)
    pre_step(run)                     before each step
    pre_optim_step(run, result)       after the step's loss is reduced over ranks, before the optimizer step;
                                      any callback returning False skips the optimizer step on every rank
                                      (the decision must be the same on every rank: base it on reduced values)
    post_step(run, result)            after each step (taken or skipped); may set run.state.exit_code to stop
    close()                           always, at the end

`default_callbacks(run)` (titanloop.train.run_callbacks) lists them in the order they run: profiling, garbage
collection, validation, metrics (stdout, metrics.jsonl, W&B; speed and MFU), checkpointing, preemption, non-finite
losses and gradient norms.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torchtitan.tools.utils import GarbageCollection

from titanloop.checkpoint import EXIT_CODE_PREEMPTED, PreemptionMonitor
from titanloop.model.config import attended_keys_per_token
from titanloop.parallel.compile import compiled_graphs
from titanloop.train.metrics import MetricsLogger
from titanloop.train.mfu import device_name, mfu, peak_flops
from titanloop.train.step_timer import breakdown_scalars, straggler_warning

EXIT_CODE_NONFINITE = 3


@dataclass
class StepResult:
    """One optimizer step as the callbacks see it (loss and statistics are means over data-parallel ranks)."""

    step: int
    n_loops: int
    loss: float
    per_loop: dict  # name -> list of floats (ce, exit_prob, hidden_rms per loop; gate_entropy, jsrr: one value)
    lr: float  # the LR of this step's optimizer step
    seconds: float = 0.0  # wall time of the step (forward, backward, optimizer)
    grad_norm: float | None = None  # None: the optimizer step was skipped
    nonfinite_grad_norm: float | None = None  # set when the gradient norm was NaN/Inf (the step was skipped)
    nonfinite_grads: list = field(default_factory=list)  # skipped steps: parameters with a non-finite local grad
    comms: dict = field(default_factory=dict)  # collectives of the step by kind (metrics.count_comms)
    doc_lengths: list = field(default_factory=list)  # this rank's packed documents (empty: plain causal attention)
    tokens: int = 0  # tokens of the step over all data-parallel ranks (train() adds them to ntokens_seen)
    validation: dict | None = None  # val/... numbers when the Validation callback ran at this step
    timings: dict = field(default_factory=dict)  # log steps: phase times and every rank's (titanloop.train.step_timer)

    @property
    def skipped(self) -> bool:
        return self.grad_norm is None


class Callback:
    def pre_train(self, run) -> None:
        pass

    def pre_step(self, run) -> None:
        pass

    def pre_optim_step(self, run, result: StepResult) -> bool:
        return True

    def post_step(self, run, result: StepResult) -> None:
        pass

    def close(self) -> None:
        pass


class GarbageCollector(Callback):
    """Python's GC off, a collection every `every` steps on every rank at once (torchtitan's GC control)."""

    def __init__(self, every: int = 50):
        self.gc = GarbageCollection(gc_freq=every)

    def pre_step(self, run) -> None:
        self.gc.run(run.state.step)


class NonFinite(Callback):
    """A non-finite loss on any rank (the reduced loss is then non-finite on every rank) or a non-finite gradient
    norm (reduced over all ranks) skips the step on every rank; on_nonfinite='skip' stops the run (exit code 3)
    after `max_nan_steps` of them in a row, 'stop' at the first. Each one is recorded, per rank, in
    <run_dir>/nonfinite/step-N.rank-R.json (loss, T, per-loop statistics, grad norm, non-finite gradients)."""

    def __init__(self, max_in_a_row: int, on_nonfinite: str = "skip"):
        self.max_in_a_row = max_in_a_row if on_nonfinite == "skip" else 1
        self.limit = (
            f"training.max_nan_steps={max_in_a_row}" if on_nonfinite == "skip" else "training.on_nonfinite='stop'"
        )

    def pre_optim_step(self, run, result: StepResult) -> bool:
        if math.isfinite(result.loss):
            return True
        self._count(run, result, f"non-finite loss ({result.loss}) on at least one rank")
        return False

    def post_step(self, run, result: StepResult) -> None:
        state = run.state
        if result.nonfinite_grad_norm is not None:
            self._count(run, result, f"non-finite gradient norm ({result.nonfinite_grad_norm})")
        elif not result.skipped:
            state.nan_streak = 0
        if result.skipped:
            self._record(run, result)
        if state.nan_streak >= self.max_in_a_row and state.exit_code is None:
            state.exit_code = EXIT_CODE_NONFINITE
            if run.mesh.rank == 0:
                print(
                    f"error: stopped at step {state.step} after {state.nan_streak} non-finite steps (loss or "
                    f"gradient norm) in a row ({self.limit}); see {self._dir(run)}",
                    file=sys.stderr,
                    flush=True,
                )

    def _count(self, run, result: StepResult, what: str) -> None:
        state = run.state
        state.nan_streak += 1
        state.skipped_steps += 1
        if run.mesh.rank == 0:
            print(
                f"step {result.step:5d} | {what}: step skipped ({state.nan_streak} in a row, limit "
                f"{self.max_in_a_row}); recorded in {self._dir(run)}",
                flush=True,
            )

    @staticmethod
    def _dir(run) -> Path:
        return Path(run.cfg.training.run_dir) / "nonfinite"

    def _record(self, run, result: StepResult) -> None:
        path = self._dir(run) / f"step-{result.step}.rank-{run.mesh.rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        fields = ("step", "n_loops", "loss", "nonfinite_grad_norm", "nonfinite_grads", "per_loop", "lr")
        path.write_text(json.dumps({k: getattr(result, k) for k in fields}, default=str, indent=1) + "\n")


class Metrics(Callback):
    """Every `log_freq` steps (and step 1): loss, per-loop statistics, grad norm, LR, tokens/s, TFLOP/s and MFU
    to stdout, <run_dir>/metrics.jsonl and W&B (titanloop.train.metrics)."""

    def __init__(self, run):
        cfg = run.cfg
        self.log_freq = cfg.metrics.log_freq
        self.logger = MetricsLogger(
            cfg.metrics, cfg.training.run_dir, run.mesh.rank, cfg.to_dict(), trained_loops=cfg.looplm.n_loops
        )
        self.window = [0, 0.0, 0.0]  # tokens, seconds and model FLOPs of the steps since the last logged one
        self.peak = peak_flops(device_name(run.mesh.device_type))  # None: MFU n/a (titanloop.train.mfu)

    def post_step(self, run, result: StepResult) -> None:
        cfg, mesh = run.cfg, run.mesh
        seq_len = cfg.training.seq_len
        tokens = run.dataloader.batch_at(result.step - 1) * seq_len
        doc_lengths = result.doc_lengths or None  # None: plain causal attention
        # Speed over every step since the last log line, not the log step alone: a log step ends each phase with a
        # barrier (metrics.breakdown), the others run as training does
        backward = cfg.loop_sampler.graph_loops(result.n_loops)  # truncated backprop: the last k loops only
        unread = 1 if cfg.objective.fixed_point_weight > 0 else 0  # the fixed-point penalty's one more loop
        flops = cfg.family.flops_per_token(seq_len, result.n_loops, doc_lengths, backward, unread) * tokens
        self.window = [self.window[0] + tokens, self.window[1] + result.seconds, self.window[2] + flops]
        if result.skipped and result.validation:  # no training numbers to show at a skipped step
            self.logger.log_validation(result.step, result.validation)
        if result.skipped or (result.step % self.log_freq and result.step != 1 and not result.validation):
            return
        (tokens, seconds, flops), self.window = self.window, [0, 0.0, 0.0]
        per_loop = dict(result.per_loop)
        flops /= seconds
        scalars = {
            "loss": result.loss,
            "n_loops": result.n_loops,
            "gate_entropy": per_loop.pop("gate_entropy")[0],
            "grad_norm": result.grad_norm,
            "lr": result.lr,
            "tokens_per_s": tokens / seconds,
            "tflops": flops / 1e12,
            "skipped_steps": run.state.skipped_steps,
            "mfu": mfu(flops, self.peak, mesh.world_size),
            "attended_keys": attended_keys_per_token(seq_len, doc_lengths),
        }
        for key in ("jsrr", "loop_change"):  # one value each, logged beside the loss
            if key in per_loop:
                scalars[key] = per_loop.pop(key)[0]
        if mesh.device_type == "cuda":  # this rank's peak since start (gpu_check compares it with the memory plan)
            scalars["max_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
        if cfg.parallelism.compile:  # Dynamo graphs compiled so far in this process: constant once warm
            scalars["compiled_graphs"] = compiled_graphs()
        scalars.update({f"comm/{kind}": n for kind, n in sorted(result.comms.items())})
        breakdown = breakdown_scalars(result.timings)
        scalars.update(breakdown)
        self.logger.log(result.step, scalars, per_loop, result.validation)
        warning = straggler_warning(result.step, breakdown, cfg.metrics.straggler_warn)
        if warning and mesh.rank == 0:
            print(warning, flush=True)

    def close(self) -> None:
        self.logger.close()


class Checkpointing(Callback):
    """Resume from the newest checkpoint in the run dir; save every checkpoint.interval steps and at the end."""

    def pre_train(self, run) -> None:
        run.checkpointer.load_latest()

    def post_step(self, run, result: StepResult) -> None:
        ckpt, step = run.checkpointer, result.step
        ckpt.maybe_save(step)
        if step == run.cfg.training.steps and ckpt.last_saved_step != step:
            ckpt.save(step, sync=True)


class Preemption(Callback):
    """SIGUSR1/SIGTERM on any rank (or the Slurm time running out): every rank saves at the same step boundary
    and the run exits with code 75 so that the job is requeued (titanloop.checkpoint.preemption)."""

    def __init__(self, run):
        c = run.cfg.checkpoint
        self.monitor = PreemptionMonitor(c.preemption_signals, slurm_time_margin_s=c.slurm_time_margin_s)

    def post_step(self, run, result: StepResult) -> None:
        ckpt, step = run.checkpointer, result.step
        if not self.monitor.should_stop(step):
            return
        if ckpt.last_saved_step != step:
            ckpt.save(step, sync=True)
        ckpt.wait()
        if run.mesh.rank == 0:
            saved = "checkpoint saved" if ckpt.cfg.enable else "checkpointing is disabled, nothing saved"
            print(
                f"[titanloop] preempted at step {step} ({self.monitor.reason}): {saved}, "
                f"exiting with code {EXIT_CODE_PREEMPTED} so the job is requeued",
                flush=True,
            )
        run.state.exit_code = EXIT_CODE_PREEMPTED
