"""`python scripts/gpu_check.py` (or scripts/gpu_check.sh): one acceptance check of the fast path on a CUDA machine
with 1-8 GPUs, ending in a PASS/FAIL table and benchmarks/results/gpu_check.json (rendered into BENCHMARKS.md by
`python -m benchmarks.report`); exit status 0 only if every check passes.

Checks, in order (the numerical ones live in titanloop.checks.numerics; tolerances: docs/scaling.md, "GPU check"):
  flash-attn        flash_attn imports (optional: without it attention uses torch's kernels; n/a then)
  attention docs    document-masked attention as the model calls it (bf16) vs a float64 reference
  attention plain   the same for plain causal attention
  bf16 logits       a trained LoopLM's last-loop logits in bf16 vs fp32, against weights-only rounding
  compile           the per-layer compiled LoopLM over T x document counts: 0 graph breaks, no recompiles
  readout           the recompute readout (per_loop_cross_entropy) in bf16 vs fp32 logits: values and gradients
  readout fused     the default training readout (objective.ce_backward = "fused"), the same rule
  fused vs recompute  seconds and peak memory of both readouts at a training shape (reported only)
  kernel choice     a 2-step compiled `torchrun -m titanloop.train` run with the kernel of every forward recorded
                    outside the compiled layers: all bf16 on CUDA, none on a fallback kernel
  train T, prec.    `torchrun -m titanloop.train` on all local GPUs (FSDP2, bf16 params, fp32 reduce, compile,
                    per-loop AC, document masking) for --steps steps on synthetic text whose motifs use 64 ids of
                    the 49K vocabulary (learned within the run), at T = 4 (--full: 4 and 8), bf16 and float8
                    tensorwise and rowwise: tokens/s/GPU, MFU and peak memory
  memory runs       bf16 at T = 4 without activation checkpointing for MEMORY_STEPS steps, compiled and eager (the
                    plan subtracts compile's saving for the compiled one: the pair checks the plan with and without
                    it); skipped when the plan exceeds the free memory
  memory plan       each run's peak (torch.cuda.max_memory_allocated) vs its memory plan within MEMORY_PLAN_RTOL
                    (--plan-json: plans computed ahead on any machine with --write-plans; device-independent)
  float8 loss       each float8 run's loss at most FLOAT8_LOSS_RTOL above the bf16 run's (one-sided: a lower
                    loss is reported, not failed); judged only when the bf16 run learned (loss fell by MIN_LEARNED)
  float8 speed      float8 tokens/s / bf16 tokens/s: tensorwise must be >= 1.0; rowwise reported
  preemption        (--preemption or --full) a small run checkpointed asynchronously on CUDA (pinned-memory
                    staging), stopped by SIGTERM and resumed: its losses after the resume vs an uninterrupted run's
                    (bitwise when two uninterrupted runs agree bitwise, else within 2x their difference)
  learning          (--learning or --full) the Ouro-1.4B shape with LEARN_MODEL (input injection of an embedding of
                    std 1.0) for LEARN_STEPS steps: last-loop CE falls steadily and ends >= 30% of the way from its
                    start to the task's entropy floor, no grad-norm spike above 10x the running median; the verdict
                    also gives p(t) and the CE per loop at the end, and the step at which the exit distribution
                    collapsed onto one loop, if it did. --learning-args="..." runs a variant (more trainer overrides,
                    e.g. "--objective.beta 0.5" or OURO_MODEL's), named in its verdict

--budget-s skips the rows that no longer fit (estimated from shared/GPU.md's H100 timings) and stops a run still
going at the budget; the json is rewritten after every row. Without CUDA it prints one line and exits 1 (`--smoke`
runs the whole orchestration on the CPU at tiny sizes). `--write-plans FILE` needs no GPU: it computes the memory
plans of the training runs (fake backend) so that a GPU call spends no time on them. Everything but the CUDA runs is
tested on CPU (tests/test_scripts_gpu_check.py).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import json
import os
import re
import signal
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's titanloop, when run as a script
sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu_procs beside it, also when loaded from a file

from gpu_procs import Budget, exit_on_sigterm, wait_or_stop  # noqa: E402

from titanloop.checks.numerics import (  # noqa: E402
    MIN_LEARNED,
    Check,
    attention_check,
    bf16_logits_check,
    compile_check,
    fused_readout_comparison,
    kernel_choice_check,
    readout_check,
    record_kernels,
)
from titanloop.model.config import LoopLMConfig, preset  # noqa: E402

RESULT_JSON = ROOT / "benchmarks" / "results" / "gpu_check.json"
TRAIN_CONFIG = ROOT / "train_configs" / "debug.toml"
SCRIPT = Path(__file__).resolve()

MEMORY_PLAN_RTOL = 0.15  # the plan's stated accuracy (tests/test_train_memory_plan.py checks it on CPU)
FLOAT8_LOSS_RTOL = 0.03  # how much higher float8's loss may end than bf16's (a-priori allowance, docs/scaling.md)
LOSS_WINDOW = 4  # logged steps averaged at the end of a run
STEPS = 60
LOG_FREQ = 5
MOTIF_VOCAB = 64  # the training runs' synthetic text draws its motifs from 63 ids of the 49K vocabulary
RECIPES = ("bf16", "tensorwise", "rowwise")
GIB = 1024**3
# bf16 dense peak FLOP/s by device name (MFU is quoted against the bf16 peak for float8 runs too, as torchtitan)
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "GH200": 989e12, "A100": 312e12, "B200": 2250e12}
# (preset, overrides) from the largest down; bytes per parameter of training state per GPU (fp32 master + Adam
# moments, sharded over GPUs) plus a fixed activation allowance, see `pick_model`.
SHAPES = [("ouro-1.4b", {}), ("ouro-1.4b", {"n_layers": 12}), ("ouro-1.4b", {"n_layers": 4}), ("debug-small", {})]
ACTIVATION_ALLOWANCE = 16 * GIB
# the learning run: Ouro-1.4B, T = 4, 2 x 4K sequences per step, Ouro's LR with a short warmup
LEARN_STEPS, LEARN_WARMUP, LEARN_LR, LEARN_PROGRESS, SPIKE_FACTOR, SPIKE_WINDOW = 150, 30, 3e-4, 0.30, 10.0, 20
# ...with the token embedding added to every loop's input at a scale the unit-RMS sublayer updates do not drown
# (std 1.0). With Ouro's defaults the motif task's loops 2-4 stop at a fixed point above loop 1 (two H100 runs,
# gpu_sessions/2026-11-27-session2 and -session3): they have lost the token identity copying needs. On CPU
# (benchmarks/probes/loop_separation.json) these two settings make the later loops beat loop 1, where neither alone
# nor any other single setting does. The row asks whether the 1.4B shape learns at every loop on this GPU;
# --learning-args="--model.embed_init_std 0.02 --model.inject_embedding false" (OURO_MODEL) runs Ouro's own settings.
LEARN_MODEL = ("--model.embed_init_std", "1.0", "--model.inject_embedding", "true")
OURO_MODEL = ("--model.embed_init_std", "0.02", "--model.inject_embedding", "false")
# the preemption row: a model that saves in seconds, SIGTERM after PREEMPT_AT steps, >= 10 compared steps after
PREEMPT_STEPS, PREEMPT_AT, PREEMPT_INTERVAL = 30, 12, 5
# the memory run: bf16 at T = 4 without activation checkpointing, long enough for the optimizer step's peak
MEMORY_AC, MEMORY_STEPS = "none", 5
# The time model of --budget-s (one H100, shared/GPU.md, measured at c79621e): a row whose estimate no longer fits
# what is left of the budget is skipped (n/a), and a run still going at the budget is stopped.
RUN_OVERHEAD_S = 30.0  # one torchrun: start, imports, build + init 1.4B, first-step compile (8.6-13.4 s)
REF_STEP_S = 0.53  # ouro-1.4b, T = 4, 1 x 4096 tokens, bf16, per-loop AC: 7,380-7,618 tokens/s
PRECISION_STEP_FACTOR = {"bf16": 1.0, "tensorwise": 1.2, "rowwise": 1.25}  # 0.84x and 0.81x of bf16's tokens/s
SINGLE_CHECKS_S, KERNEL_CHOICE_S, PREEMPTION_S = 60.0, 45.0, 150.0
# A memory plan computed during the run (none in --plan-json) costs this much per looped layer call of its step, on
# the slower of its recipes: ouro-1.4b at T = 8 (192 calls) took 377 s for rowwise and 202 s for bf16 on a 2-core CPU
# (2026-11-28, at caa3aed; before it the 1.4B bf16 plan took ~490 s, and 80 s was assumed). The same two plans took
# 57 s and 116 s on another 2-core machine of this workplace (2026-11-29, ee393be): CPUs differ ~3.5x, and the figure
# keeps the slower one, so a plan the budget starts always finishes. Give --plan-json instead.
PLAN_S_PER_LAYER_CALL = 2.0


@dataclass
class RunResult:
    """One training run of gpu_check: what its metrics.jsonl and memory plan say."""

    n_loops: int
    precision: str  # bf16 | tensorwise | rowwise
    error: str | None = None  # the run failed (its log's last lines), or was skipped or stopped at the budget
    skipped: bool = False  # not run: it did not fit the budget or the free memory (its loss and speed are n/a)
    ac: str = "loop"  # --parallelism.activation_checkpoint (the memory runs: MEMORY_AC)
    compiled: bool = True  # --parallelism.compile (the second memory run: eager)
    tokens_per_s_gpu: float | None = None
    mfu: float | None = None
    peak_gib: float | None = None
    plan_gib: float | None = None
    loss_first: float | None = None
    loss_last: float | None = None  # mean of the last LOSS_WINDOW logged steps


def no_cuda_message() -> str | None:
    """The one line printed without CUDA, or None when CUDA is available."""
    import torch

    if torch.cuda.is_available():
        return None
    return (
        "gpu_check: no CUDA device (torch.cuda.is_available() is False): run it on a machine with NVIDIA "
        "GPUs and a CUDA build of torch (`--write-plans FILE` alone needs none)"
    )


def state_bytes(cfg: LoopLMConfig, n_gpus: int) -> float:
    """Training state per GPU: fp32 params + grads + two Adam moments (16 B/param), sharded by FSDP2, plus the
    looped stack held unsharded in bf16 (reshard_looped='never')."""
    looped = cfg.layer_params() * (cfg.n_layers + cfg.n_coda_layers)
    return 16 * cfg.param_count() / n_gpus + 2 * looped


def pick_model(free_bytes: float, n_gpus: int) -> tuple[str, dict]:
    """The largest shape in SHAPES whose training state plus ACTIVATION_ALLOWANCE fits in `free_bytes`."""
    for name, overrides in SHAPES:
        if state_bytes(preset(name, **overrides), n_gpus) + ACTIVATION_ALLOWANCE <= free_bytes:
            return name, overrides
    return SHAPES[-1]


def peak_flops(device_name: str) -> float | None:
    """The bf16 dense peak of a GPU by its name (torch.cuda.get_device_name), None when unknown."""
    for key in sorted(PEAK_FLOPS, key=len, reverse=True):  # GH200 before H200
        if key in device_name.upper():
            return PEAK_FLOPS[key]
    return None


def throughput(
    rows: list[dict], cfg: LoopLMConfig, seq_len: int, n_gpus: int, n_loops: int, peak: float | None
) -> tuple[float, float | None]:
    """(tokens/s/GPU, MFU) from metrics.jsonl rows of a run, skipping the first logged step (compilation)."""
    rows = [r for r in rows if r["step"] > 1] or rows
    tok_s = sum(r["tokens_per_s"] for r in rows) / len(rows)
    mfu = None if peak is None else tok_s * cfg.flops_per_token(seq_len, n_loops=n_loops) / (peak * n_gpus)
    return tok_s / n_gpus, mfu


# ----- commands --------------------------------------------------------------------------------------------
def train_args(
    run_dir: Path,
    name: str,
    overrides: dict,
    n_loops: int,
    seq_len: int,
    n_gpus: int,
    precision: str = "bf16",
    steps: int = STEPS,
    micro_batch: int = 1,
    ac: str = "loop",
) -> list[str]:
    """Overrides of TRAIN_CONFIG for one gpu_check training run (also what its memory plan is computed for).
    Synthetic text at the Ouro vocabulary with motifs from MOTIF_VOCAB ids (a task the 1.4B shape learns within the
    run), AdamW at 1e-3, per-loop activation checkpointing as every stage config unless `ac` says otherwise (without
    it 1.4B at T=8, 4K needs 107 GB per GPU, benchmarks/results/memory_plan.json); `precision` bf16 adds nothing
    (training.dtype auto is bf16 on GPU), a float8 recipe adds `--float8.recipe <recipe>`."""
    if precision not in RECIPES:
        raise ValueError(f"precision {precision!r}: expected one of {RECIPES}")
    args = {
        "model.vocab_size": 49152,
        "data.motif_vocab": MOTIF_VOCAB,
        "training.run_dir": run_dir,
        "training.steps": steps,
        "training.seq_len": seq_len,
        "training.micro_batch_size": micro_batch,
        "training.global_batch_size": micro_batch * n_gpus,
        "model.preset": name,
        "loop_sampler.n_loops": n_loops,
        "optimizer.lr": 1e-3,
        "lr_scheduler.warmup_steps": 10,
        "parallelism.compile": "true",
        "parallelism.activation_checkpoint": ac,
        "metrics.log_freq": LOG_FREQ,
        "metrics.wandb": "off",
        "checkpoint.enable": "false",
        **{f"model.{k}": v for k, v in overrides.items()},
    }
    if precision != "bf16":
        args["float8.recipe"] = precision
    return [item for key, value in args.items() for item in (f"--{key}", str(value))]


def torchrun_command(python: str, n_gpus: int, args: list[str], prefix: list[str] | None = None) -> list[str]:
    """`python -m torch.distributed.run ... -m titanloop.train` for `args`, or with `prefix` another entry point
    (the kernel recorder: [this script, "--record-kernels", FILE])."""
    entry = prefix or ["-m", "titanloop.train"]
    return [
        python,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={n_gpus}",
        *entry,
        "--config",
        str(TRAIN_CONFIG),
        *args,
    ]


def missing_modules(precision: str = "bf16") -> list[str]:
    """Modules a gpu_check training run needs that this interpreter cannot import (an existing interpreter given
    with --python may have torch but not the project's other dependencies)."""
    import importlib.util

    needed = ["torchtitan"] + (["torchao"] if precision != "bf16" else [])
    return [m for m in needed if importlib.util.find_spec(m) is None]


# Bumped when the plan's model changes, so that a plans.json written by older code is not reused (its keys no longer
# match). 2: the plan includes compile's saving (titanloop.train.memory_plan.compiled_saving_bytes).
PLAN_FORMAT = 2


def plan_key(args: list[str], n_gpus: int) -> str:
    """What a memory plan depends on: the plan's format, the training arguments without the run dir, the GPU count."""
    i = args.index("--training.run_dir")
    return json.dumps([f"plan {PLAN_FORMAT}", n_gpus, args[:i] + args[i + 2 :]])


# ----- verdicts (no GPU needed) ------------------------------------------------------------------------------
def memory_plan_check(label: str, measured_gib: float | None, planned_gib: float | None) -> Check:
    """Measured peak vs planned peak (GiB): PASS within MEMORY_PLAN_RTOL of the plan (which includes what compile
    saves where titanloop.train.memory_plan models it; the plan's notes say which)."""
    numbers = {"measured_gib": measured_gib, "planned_gib": planned_gib, "rtol": MEMORY_PLAN_RTOL}
    if measured_gib is None or planned_gib is None:
        return Check(label, False, f"missing: measured {measured_gib}, planned {planned_gib}", numbers)
    rel = measured_gib / planned_gib - 1
    detail = f"measured {measured_gib:.2f} GiB, planned {planned_gib:.2f} GiB ({100 * rel:+.0f}%, "
    detail += f"tol {100 * MEMORY_PLAN_RTOL:.0f}%)"
    return Check(label, abs(rel) <= MEMORY_PLAN_RTOL, detail, {**numbers, "rel": rel})


def loss_window(rows: list[dict]) -> tuple[float, float]:
    """(first logged loss, mean loss of the last LOSS_WINDOW logged steps) of a run's metrics rows."""
    last = rows[-LOSS_WINDOW:]
    return rows[0]["loss"], sum(r["loss"] for r in last) / len(last)


def float8_checks(runs: list[RunResult]) -> list[Check]:
    """float8 vs bf16 at the same T: the loss (FLOAT8_LOSS_RTOL, judged only if bf16 learned) and tokens/s
    (tensorwise >= 1.0x; rowwise reported)."""
    checks = []
    runs = [r for r in runs if r.ac == "loop" and r.compiled]  # (not the memory runs)
    bf16 = {r.n_loops: r for r in runs if r.precision == "bf16"}
    for r in runs:
        if r.precision == "bf16":
            continue
        label, base = f"float8 {r.precision} T={r.n_loops}", bf16.get(r.n_loops)
        if r.error or base is None or base.error:
            why = r.error or (f"no bf16 run at T={r.n_loops}" if base is None else f"bf16 run failed: {base.error}")
            skipped = r.skipped or (base is not None and base.skipped)
            checks.append(Check(f"{label} loss", None if skipped else False, why))
            continue
        checks.append(_float8_loss(label, r, base))
        ratio = r.tokens_per_s_gpu / base.tokens_per_s_gpu
        rule = r.precision == "tensorwise"
        checks.append(
            Check(
                f"{label} speed",
                (ratio >= 1.0) if rule else None,
                f"{r.tokens_per_s_gpu:,.0f} vs bf16 {base.tokens_per_s_gpu:,.0f} tokens/s/GPU "
                f"({ratio:.2f}x{', needs >= 1.00x' if rule else ', reported only'})",
                {"ratio": ratio, "target": ">= 1.0" if rule else None},
            )
        )
    return checks


def _float8_loss(label: str, r: RunResult, base: RunResult) -> Check:
    # One-sided: the check exists to catch float8 hurting training. On the first H100 run (6326f59, 40 steps, one
    # seed) both float8 recipes ended 5-10% *below* bf16, and the bf16 run's own logged loss moved by up to 13%
    # between log steps on that plateau, so a two-sided 3% band failed on the spread of single trajectories.
    learned = 1 - base.loss_last / base.loss_first
    rel = (r.loss_last - base.loss_last) / base.loss_last
    numbers = {"loss": r.loss_last, "bf16_loss": base.loss_last, "rel": rel, "rtol": FLOAT8_LOSS_RTOL}
    numbers["bf16_learned"] = learned
    if learned < MIN_LEARNED:
        why = (
            f"not judgeable: the bf16 run's loss fell only {100 * learned:.0f}% ({base.loss_first:.3f} -> "
            f"{base.loss_last:.3f}, needs {100 * MIN_LEARNED:.0f}%)"
        )
        return Check(f"{label} loss", False, why, numbers)
    detail = (
        f"{r.loss_last:.4f} vs bf16 {base.loss_last:.4f} ({100 * rel:+.2f}%; at most +{100 * FLOAT8_LOSS_RTOL:.0f}%)"
    )
    return Check(f"{label} loss", rel <= FLOAT8_LOSS_RTOL, detail, numbers)


def learning_check(rows: list[dict], floor: float) -> Check:
    """A learning run's metrics rows (every step logged) against the task's entropy floor (a lower bound): the
    last loop's CE falls steadily (each quarter of the run lower on average than the one before) and its mean over
    the last 10 steps lies >= LEARN_PROGRESS of the way from its mean over the first 3 steps to the floor; no
    gradient norm above SPIKE_FACTOR x the median of the SPIKE_WINDOW steps before it."""
    ce = [r["ce"][-1] for r in rows]
    norms = [r.get("grad_norm") for r in rows]
    start, end = statistics.mean(ce[:3]), statistics.mean(ce[-10:])
    progress = (start - end) / (start - floor) if start > floor else 0.0
    q = max(1, len(ce) // 4)
    quarters = [statistics.mean(ce[i * q : (i + 1) * q]) for i in range(4)]
    steady = all(b < a for a, b in zip(quarters, quarters[1:]))
    spikes = []
    for i in range(SPIKE_WINDOW, len(norms)):
        window = [n for n in norms[i - SPIKE_WINDOW : i] if n is not None]
        if norms[i] is not None and window and norms[i] > SPIKE_FACTOR * statistics.median(window):
            spikes.append((rows[i]["step"], round(norms[i], 2), round(statistics.median(window), 2)))
    ok = progress >= LEARN_PROGRESS and steady and not spikes
    numbers = {
        "ce_start": start,
        "ce_end": end,
        "floor": floor,
        "progress": progress,
        "quarters": quarters,
        "spikes": spikes,
        "steps": len(rows),
        # the whole curve: step, last-loop CE, gradient norm, the largest per-loop hidden RMS
        "curve": [[r["step"], r["ce"][-1], r.get("grad_norm"), max(r.get("hidden_rms") or [0])] for r in rows],
        **exit_summary(rows),
    }
    detail = (
        f"last-loop CE {start:.3f} -> {end:.3f}, floor >= {floor:.3f}: {100 * progress:.0f}% of the way (needs "
        f"{100 * LEARN_PROGRESS:.0f}%); quarters {' > '.join(f'{x:.2f}' for x in quarters)}"
        f"{'' if steady else ' (not falling steadily)'}; {len(spikes)} grad-norm spikes > {SPIKE_FACTOR:g}x median"
    )
    if numbers.get("exit_prob_end"):
        p_end, ce_end = numbers["exit_prob_end"], numbers["ce_per_loop_end"]
        detail += f"; at the end p(t) {' '.join(f'{x:.2f}' for x in p_end)}, CE per loop "
        detail += " ".join(f"{x:.2f}" for x in ce_end)
        if numbers["exit_collapsed_at"] is not None:
            t, step = numbers["exit_collapsed_at"]
            detail += f" (exit distribution collapsed onto loop {t} at step {step})"
    return Check("learning", ok, detail, numbers)


def exit_summary(rows: list[dict], last: int = 10, collapsed: float = 0.99) -> dict:
    """The exit distribution of a run with an exit gate (Stage I): p(t) and CE per loop averaged over the last
    `last` logged steps, and the first (loop, step) at which one loop held more than `collapsed` of p. A loop that
    takes all of p is the only one the Stage I loss trains, so the other loops' CE stops falling."""
    with_p = [r for r in rows if r.get("exit_prob") and r.get("ce")]
    if not with_p:
        return {}
    tail = with_p[-last:]
    first = next(((max(range(len(r["exit_prob"])), key=r["exit_prob"].__getitem__) + 1, r["step"])
                  for r in with_p if max(r["exit_prob"]) > collapsed), None)  # fmt: skip
    return {
        "exit_prob_end": [statistics.mean(r["exit_prob"][t] for r in tail) for t in range(len(tail[-1]["exit_prob"]))],
        "ce_per_loop_end": [statistics.mean(r["ce"][t] for r in tail) for t in range(len(tail[-1]["ce"]))],
        "exit_collapsed_at": first,
    }


def preemption_verdict(reference: list[dict], repeat: list[dict], resumed: list[dict], resumed_from: int) -> Check:
    """Losses of the resumed run after `resumed_from` vs the uninterrupted reference: bitwise when the reference
    and its repeat agree bitwise over those steps, else within 2x the largest reference-vs-repeat difference
    (CUDA kernels that accumulate with atomics differ run to run; a resume that loses a state differs far more)."""
    ref = {r["step"]: r["loss"] for r in reference}
    rep = {r["step"]: r["loss"] for r in repeat}
    got = {r["step"]: r["loss"] for r in resumed if r["step"] > resumed_from}
    steps = sorted(s for s in got if s in ref)
    if len(steps) < 10:
        return Check("preemption", False, f"only {len(steps)} steps after the resume to compare (needs >= 10)")
    noise = max(abs(ref[s] - rep[s]) for s in steps if s in rep)
    diff = max(abs(got[s] - ref[s]) for s in steps)
    bound = 2 * noise
    ok = diff == 0 if noise == 0 else diff <= bound
    rule = "bitwise (the reference repeats bitwise)" if noise == 0 else f"<= 2 x run-to-run {noise:.2e}"
    detail = (
        f"resumed at step {resumed_from}, {len(steps)} steps compared: max |loss - uninterrupted| {diff:.2e}, {rule}"
    )
    return Check("preemption", ok, detail, {"max_abs_diff": diff, "run_to_run": noise, "steps": steps})


def format_table(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = [f"{'check':<{width}}  result  detail", f"{'-' * width}  ------  ------"]
    for c in checks:
        lines.append(f"{c.name:<{width}}  {verdict(c):<6}  {c.detail}")
    return "\n".join(lines)


def verdict(c: Check) -> str:
    return "n/a" if c.ok is None else ("PASS" if c.ok else "FAIL")


def exit_status(checks: list[Check]) -> int:
    return 0 if all(c.ok is not False for c in checks) and any(c.ok for c in checks) else 1


# ----- the kernel recorder's entry point (inside a torchrun worker) --------------------------------------------
def record_kernels_main(out: str, train_argv: list[str]) -> int:
    """`torchrun ... scripts/gpu_check.py --record-kernels OUT --config ... [overrides]`: the trainer's own main
    with the recorder installed (titanloop.checks.numerics.record_kernels); rank 0 writes the records to OUT."""
    from titanloop.train.__main__ import main as train_main

    records: list = []
    record_kernels(records)
    code = train_main(train_argv)
    if os.environ.get("RANK", "0") == "0":
        Path(out).write_text(json.dumps(records))
    return code


# ----- the CUDA-only orchestration (not run in CI: no GPU) -----------------------------------------------------
def _check_flash() -> Check:
    from titanloop.model.attention import flash_available

    if flash_available():
        return Check("flash-attn", True, "importable")
    return Check(
        "flash-attn",
        None,
        "not installed (optional: attention uses torch's kernels; pip install 'titanloop[gpu]' where a wheel exists)",
    )


def _fused_vs_recompute() -> Check:
    res = fused_readout_comparison("cuda")
    s, b = res["seconds"], res["peak_bytes"]
    detail = (
        f"fused {s['fused']:.3f} s, {b['fused'] / GIB:.2f} GiB vs recompute {s['recompute']:.3f} s, "
        f"{b['recompute'] / GIB:.2f} GiB; max rel diff {max(res['max_rel_err'].values()):.1e}"
    )
    return Check("fused vs recompute", None, detail, res)


def _single_gpu_checks() -> list[Check]:
    import torch

    doc_ids = torch.tensor([[0] * 300 + [1] * 700 + [2] * 24, [0] * 1024])
    single = [
        ("flash-attn", _check_flash),
        ("attention docs", lambda: attention_check("attention docs", "cuda", doc_ids)),
        ("attention plain", lambda: attention_check("attention plain", "cuda")),
        ("bf16 logits", lambda: bf16_logits_check("cuda")),
        ("compile", lambda: compile_check("cuda")),
        ("readout", lambda: readout_check("cuda")),
        ("readout fused", lambda: readout_check("cuda", fused=True)),
        ("fused vs recompute", _fused_vs_recompute),
    ]
    checks = []
    for label, fn in single:
        try:
            checks.append(fn())
        except Exception as e:  # noqa: BLE001 - a failing check is a FAIL row, the others still run
            checks.append(Check(label, False, f"{type(e).__name__}: {e}"[:200]))
        print(format_table(checks[-1:]).splitlines()[-1], flush=True)
    return checks


def run_logged(
    cmd: list[str], log: Path, timeout: float | None, env: dict | None = None, cwd: Path | None = None
) -> int | None:
    """Run `cmd` in its own process group with stdout and stderr appended to `log` (a file, not a pipe: a pipe
    nobody reads blocks the run when it fills); its exit code, or None when it was still running after `timeout`
    seconds and was stopped with its group (gpu_procs.wait_or_stop: torchrun's workers go with it). Also
    benchmarks/gpu_throughput.py's launcher."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=cwd, env=env, start_new_session=True)
    return wait_or_stop(proc, None if timeout is None else max(timeout, 1.0))


_ERROR_LINE = re.compile(r"^(error: |[\w.]*(Error|Exception)\b)")


def log_tail(log: Path, chars: int = 300) -> str:
    """What a failed run's log says went wrong: its last error line (`error: ...` from the trainer's config
    checks, or an exception's `XError: ...`, torchrun's ChildFailedError left out), else its last 3 lines."""
    text = log.read_text(errors="replace") if log.is_file() else ""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if _ERROR_LINE.match(line) and "ChildFailedError" not in line]
    return (errors[-1] if errors else " | ".join(lines[-3:]))[:chars]


def _failed(code: int | None, log: Path) -> str:
    if code is None:
        return f"stopped at the budget (--budget-s); log: {log.name}"
    return f"exit {code}: {log_tail(log)}"


def run_estimate_s(
    name: str, overrides: dict, n_loops: int, seq_len: int, micro_batch: int, steps: int, precision: str = "bf16"
) -> float:
    """Seconds one training run takes on one H100: RUN_OVERHEAD_S plus its steps, each REF_STEP_S scaled by its
    FLOPs against the reference (ouro-1.4b, T = 4, 1 x 4096 tokens) and by the precision's measured factor."""
    cfg = preset(name, **overrides, n_loops=n_loops)
    ref = preset("ouro-1.4b", n_loops=4)
    flops = cfg.flops_per_token(seq_len, n_loops=n_loops) * seq_len * micro_batch
    step = REF_STEP_S * flops / (ref.flops_per_token(4096, n_loops=4) * 4096) * PRECISION_STEP_FACTOR[precision]
    return RUN_OVERHEAD_S + steps * step


def plan_estimate_s(name: str, overrides: dict, n_loops: int) -> float:
    """Seconds the memory plan of one training run takes when computed during the run (PLAN_S_PER_LAYER_CALL)."""
    return PLAN_S_PER_LAYER_CALL * preset(name, **overrides, n_loops=n_loops).n_layers * n_loops


def _check_kernel_choice(a: argparse.Namespace, workdir: Path) -> Check:
    out = workdir / "kernels.json"
    if missing_modules():
        return Check("kernel choice", False, f"{sys.executable} cannot import {missing_modules()}")
    skip = a.budget.skip_reason(KERNEL_CHOICE_S)
    if skip:
        return Check("kernel choice", None, skip)
    args = train_args(workdir / "kernels", a.name, {**a.overrides, "n_layers": 2}, 4, 1024, 1, steps=2)
    cmd = torchrun_command(sys.executable, 1, args, [str(SCRIPT), "--record-kernels", str(out)])
    log = workdir / "kernels.log"
    code = run_logged(cmd, log, a.budget.left())
    if code != 0 or not out.is_file():
        return Check("kernel choice", False, _failed(code, log))
    return kernel_choice_check(json.loads(out.read_text()))


def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


@dataclass(frozen=True)
class RunSpec:
    """One training run of gpu_check: T, precision, AC policy and steps (the memory run: bf16, AC none, few steps)."""

    n_loops: int
    precision: str
    ac: str = "loop"
    steps: int = STEPS
    compiled: bool = True

    @property
    def label(self) -> str:
        ac = "" if self.ac == "loop" else f" AC {self.ac}"
        return f"T={self.n_loops} {self.precision}{ac}" + ("" if self.compiled else " eager")

    def args(self, a: argparse.Namespace, run_dir: Path) -> list[str]:
        args = train_args(
            run_dir, a.name, a.overrides, self.n_loops, a.seq_len, a.n_gpus, self.precision, self.steps,
            a.micro_batch, self.ac,
        )  # fmt: skip
        # --smoke: eager (torchao's float8 emulation on the CPU runs eager only; the kernel choice run compiles)
        eager = not self.compiled or getattr(a, "smoke", False)
        return args + (["--parallelism.compile", "false"] if eager else [])


def training_runs(a: argparse.Namespace) -> list[RunSpec]:
    """The training runs these arguments make, in order: T x precision with per-loop AC (--steps steps each), then
    unless --skip-memory-run the memory runs (bf16, T = 4, AC none, MEMORY_STEPS steps), compiled and eager: the
    plan subtracts compile's saving for the compiled run only, so the pair checks the plan with and without it."""
    runs = [RunSpec(t, p, "loop", a.steps) for t, p in itertools.product(a.loops, a.precisions)]
    if not a.skip_memory_run:
        runs += [RunSpec(4, "bf16", MEMORY_AC, MEMORY_STEPS), RunSpec(4, "bf16", MEMORY_AC, MEMORY_STEPS, False)]
    return runs


def _train(a: argparse.Namespace, spec: RunSpec, workdir: Path, plans: dict) -> tuple[RunResult, list[Check]]:
    run_dir = workdir / f"T{spec.n_loops}-{spec.precision}-{spec.ac}{'' if spec.compiled else '-eager'}"
    args = spec.args(a, run_dir)
    label, plan_label = f"train {spec.label}", f"memory plan {spec.label}"

    def not_run(why: str, skipped: bool = False) -> tuple[RunResult, list[Check]]:
        res = RunResult(spec.n_loops, spec.precision, error=why, skipped=skipped, ac=spec.ac, compiled=spec.compiled)
        return res, [Check(label, None if skipped else False, why)]

    missing = missing_modules(spec.precision)
    if missing:
        return not_run(f"{sys.executable} cannot import {missing}")
    key = plan_key(args, a.n_gpus)
    plan = plans.get(key)
    if plan is not None and a.free_bytes is not None and plan * GIB > a.free_bytes:
        return not_run(f"skipped: its plan is {plan:.2f} GiB, {a.free_bytes / GIB:.1f} GiB free", skipped=True)
    estimate = run_estimate_s(a.name, a.overrides, spec.n_loops, a.seq_len, a.micro_batch, spec.steps, spec.precision)
    skip = a.budget.skip_reason(estimate)
    if skip:
        return not_run(skip, skipped=True)
    log = workdir / f"{run_dir.name}.log"
    code = run_logged(torchrun_command(sys.executable, a.n_gpus, args), log, a.budget.left())
    rows = _metrics(run_dir)
    if code != 0 or not rows:
        return not_run(_failed(code, log) if code != 0 else f"no metrics logged: {log_tail(log)}")
    cfg = preset(a.name, **a.overrides, n_loops=spec.n_loops)
    tok_s, mfu = throughput(rows, cfg, a.seq_len, a.n_gpus, spec.n_loops, a.peak)
    first, last = loss_window(rows)
    res = RunResult(spec.n_loops, spec.precision, tokens_per_s_gpu=tok_s, mfu=mfu, loss_first=first, loss_last=last)
    res.ac, res.compiled = spec.ac, spec.compiled
    res.peak_gib = max(r.get("max_mem_gib") or 0 for r in rows) or None
    mfu_text = "n/a" if mfu is None else f"{100 * mfu:.1f}%"
    detail = f"{a.shape_text} {tok_s:,.0f} tokens/s/GPU, MFU {mfu_text}, loss {first:.3f} -> {last:.3f}"
    numbers = {
        k: v for k, v in asdict(res).items() if k not in ("n_loops", "precision", "error", "skipped", "ac", "compiled")
    }
    checks = [Check(label, True, detail, numbers)]
    short = None if plan is not None else a.budget.shortfall(plan_estimate_s(a.name, a.overrides, spec.n_loops))
    if short:
        return res, checks + [Check(plan_label, None, f"not planned: none in --plan-json, and computing one ({short})")]
    try:
        res.plan_gib = plan if plan is not None else planned_peak_gib(TRAIN_CONFIG, args, a.n_gpus)
    except Exception as e:  # noqa: BLE001 - reported as a FAIL row
        return res, checks + [Check(plan_label, False, f"plan failed: {type(e).__name__}: {e}"[:200])]
    if res.peak_gib is None and not a.cuda:
        return res, checks + [Check(plan_label, None, f"planned {res.plan_gib:.2f} GiB; no CUDA peak on the CPU")]
    return res, checks + [memory_plan_check(plan_label, res.peak_gib, res.plan_gib)]


def memory_plan_of(config: Path, args: list[str], n_gpus: int):
    """The dry run's MemoryPlan of `config` + `args` at `n_gpus` ranks (fake backend, meta tensors)."""
    from titanloop.train.config import load_config
    from titanloop.train.dry_run import dry_run

    return dry_run(load_config(config, args, world_size=n_gpus), n_gpus, memory_plan=True).memory_plan


def planned_peak_gib(config: Path, args: list[str], n_gpus: int) -> float:
    """The memory plan's peak (GiB per GPU) of `config` + `args` at `n_gpus` ranks."""
    return memory_plan_of(config, args, n_gpus).peak / GIB


def write_plans(a: argparse.Namespace) -> int:
    """--write-plans FILE: the memory plan of every training run these arguments make (no GPU needed)."""
    plans = {}
    for spec in training_runs(a):
        args = spec.args(a, Path("x"))
        start = time.perf_counter()
        gib = plans[plan_key(args, a.n_gpus)] = planned_peak_gib(TRAIN_CONFIG, args, a.n_gpus)
        print(f"plan {spec.label}: {gib:.2f} GiB ({time.perf_counter() - start:.0f} s)", flush=True)
    Path(a.write_plans).write_text(json.dumps(plans, indent=1) + "\n")
    print(f"wrote {a.write_plans}: pass it as --plan-json on the GPU machine (the same --shape and options)")
    return 0


def estimates(a: argparse.Namespace) -> list[tuple[str, float]]:
    """(row, estimated seconds on one H100) of every row these arguments run, in order: what --budget-s uses."""
    rows = [] if a.skip_single else [("single-GPU checks", SINGLE_CHECKS_S)]
    rows += [] if a.skip_kernel_choice else [("kernel choice", KERNEL_CHOICE_S)]
    for spec in [] if a.skip_train else training_runs(a):
        est = run_estimate_s(a.name, a.overrides, spec.n_loops, a.seq_len, a.micro_batch, spec.steps, spec.precision)
        rows.append((f"train {spec.label}", est))
    if a.preemption:
        rows.append(("preemption", PREEMPTION_S))
    if a.learning:
        rows.append(("learning", run_estimate_s("ouro-1.4b", {}, 4, 4096, 2, LEARN_STEPS)))
    return rows


def print_estimate(a: argparse.Namespace) -> int:
    """--estimate: each row's estimated seconds on one H100 (shared/GPU.md's timings) and the total; no GPU."""
    total = 0.0
    for row, seconds in estimates(a):
        total += seconds
        print(f"{row:<32} {seconds:5.0f} s  (total {total:4.0f} s)")
    print(f"estimated {total:.0f} s on one H100 for {a.name}; --budget-s skips the rows past the budget")
    return 0


# ----- the preemption and learning rows ------------------------------------------------------------------------
def _preempt_args(run_dir: Path) -> list[str]:
    return [
        *train_args(run_dir, "debug-small", {}, 4, 1024, 1, steps=PREEMPT_STEPS),
        *("--metrics.log_freq", "1", "--parallelism.compile", "false", "--checkpoint.enable", "true"),
        *("--checkpoint.interval", str(PREEMPT_INTERVAL), "--checkpoint.mode", "async", "--data.motif_vocab", "0"),
    ]


def _launch(args: list[str], log: Path) -> subprocess.Popen:
    with open(log, "a") as f:  # (a file, not a pipe: a pipe nobody reads would block the run when it fills)
        return subprocess.Popen(
            torchrun_command(sys.executable, 1, args), stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )


def _check_preemption(a: argparse.Namespace, workdir: Path) -> Check:
    """Reference, repeat, and a run SIGTERMed after PREEMPT_AT logged steps then resumed (async CUDA saves)."""
    skip = a.budget.skip_reason(PREEMPTION_S)
    if skip:
        return Check("preemption", None, skip)
    dirs = {k: workdir / f"preempt-{k}" for k in ("ref", "rep", "cut")}
    logs = {k: workdir / f"preempt-{k}.log" for k in dirs}

    def wait(proc: subprocess.Popen) -> int | None:
        return wait_or_stop(proc, a.budget.timeout(600))

    for k in ("ref", "rep"):
        code = wait(_launch(_preempt_args(dirs[k]), logs[k]))
        if code != 0:
            return Check("preemption", False, f"uninterrupted run: {_failed(code, logs[k])}")
    cut = _launch(_preempt_args(dirs["cut"]), logs["cut"])
    deadline = time.time() + 600
    while len(_metrics(dirs["cut"])) < PREEMPT_AT and cut.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    cut.send_signal(signal.SIGTERM)  # torchrun forwards it; the trainer saves (async on CUDA) and exits 75
    wait(cut)
    out = logs["cut"].read_text()
    if "preempted at step " not in out:
        return Check(
            "preemption", False, f"the SIGTERMed run did not save and stop (exit {cut.returncode}): {out[-200:]}"
        )
    resumed_from = int(out.split("preempted at step ")[1].split()[0])
    code = wait(_launch(_preempt_args(dirs["cut"]), logs["cut"]))
    if code != 0:
        return Check("preemption", False, f"the resumed run: {_failed(code, logs['cut'])}")
    return preemption_verdict(_metrics(dirs["ref"]), _metrics(dirs["rep"]), _metrics(dirs["cut"]), resumed_from)


def learning_args(run_dir: Path, n_gpus: int, extra: list[str] = ()) -> list[str]:
    """The learning run's trainer overrides; `extra` (--learning-args) come last, so they win."""
    return [
        *train_args(run_dir, "ouro-1.4b", {}, 4, 4096, n_gpus, steps=LEARN_STEPS, micro_batch=2),
        *("--metrics.log_freq", "1", "--optimizer.lr", str(LEARN_LR), "--lr_scheduler.warmup_steps", str(LEARN_WARMUP)),
        *("--lr_scheduler.decay_ratio", "0.0"),
        *LEARN_MODEL,
        *extra,
    ]


def learning_model(args: list[str], n_gpus: int) -> dict:
    """The loop-separating settings the learning run trains with, as the trainer resolves its arguments (so an
    override in --learning-args shows, not LEARN_MODEL's defaults)."""
    from titanloop.train.config import load_config

    looplm = load_config(TRAIN_CONFIG, args, world_size=n_gpus).looplm
    return {"embed_init_std": looplm.embed_init_std, "inject_embedding": looplm.inject_embedding}


def learning_floor(seq_len: int = 4096) -> float:
    from titanloop.data.synthetic_text import SyntheticTextSource

    return SyntheticTextSource(seq_len, 49152, 0, motif_vocab=MOTIF_VOCAB).entropy_floor()


def _check_learning(a: argparse.Namespace, workdir: Path) -> Check:
    skip = a.budget.skip_reason(run_estimate_s("ouro-1.4b", {}, 4, 4096, 2, LEARN_STEPS))
    if skip:
        return Check("learning", None, skip)
    run_dir, log = workdir / "learning", workdir / "learning.log"
    args = learning_args(run_dir, a.n_gpus, a.learning_extra)
    cmd = torchrun_command(sys.executable, a.n_gpus, args)
    code = run_logged(cmd, log, a.budget.left())
    rows = _metrics(run_dir)
    if code != 0 or not rows:
        return Check("learning", False, _failed(code, log) if code != 0 else f"no metrics logged: {log_tail(log)}")
    check = learning_check(rows, learning_floor())
    check.numbers["model"] = learning_model(args, a.n_gpus)
    if a.learning_extra:  # a variant of the run: its verdict says which
        check.numbers["extra_args"] = list(a.learning_extra)
        check.detail = f"with {' '.join(a.learning_extra)}: {check.detail}"
    return check


# ----- the result json ---------------------------------------------------------------------------------------
def git_commit() -> str:
    """HEAD of this checkout, with '+dirty' when tracked files differ from it; 'unknown' outside git."""
    try:
        head = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _summary(checks: list[Check], runs: list[RunResult], shape: str, seq_len: int) -> list[dict]:
    passed = sum(1 for c in checks if c.ok)
    judged = sum(1 for c in checks if c.ok is not None)
    rows = [{"row": "gpu_check: checks passed", "measured": f"{passed}/{judged}", "target": "all"}]
    rows[0]["met"] = passed == judged and judged > 0
    by = {(r.n_loops, r.precision): r for r in runs if r.ac == "loop" and r.compiled}
    base = by.get((4, "bf16"))
    if base is None or base.error is not None:
        return rows
    rows.append(
        {"row": f"tokens/s/GPU, T=4, bf16 ({shape}, {seq_len} tokens)", "measured": round(base.tokens_per_s_gpu)}
    )
    if base.mfu is not None:
        rows.append({"row": "MFU, T=4, bf16", "measured": round(base.mfu, 4)})
    f8 = by.get((4, "tensorwise"))
    if f8 is not None and f8.error is None:
        ratio = round(f8.tokens_per_s_gpu / base.tokens_per_s_gpu, 3)
        rows.append({"row": "float8 tensorwise / bf16 tokens/s, T=4", "measured": ratio, "target": ">= 1.0"})
        rows[-1]["met"] = ratio >= 1.0
    return [{"target": None, "met": None, **r} for r in rows]


def _run_table(runs: list[RunResult], shape: str, seq_len: int, steps: int) -> dict:
    def fmt(x, spec):
        return "" if x is None else format(x, spec)

    rows = [
        [
            r.n_loops,
            r.precision,
            r.ac + ("" if r.compiled else ", eager"),
            fmt(r.tokens_per_s_gpu, ",.0f"),
            fmt(r.mfu and 100 * r.mfu, ".1f"),
            fmt(r.peak_gib, ".2f"),
            fmt(r.plan_gib, ".2f"),
            "" if r.loss_first is None else f"{r.loss_first:.3f} -> {r.loss_last:.3f}",
            r.error or "",
        ]
        for r in runs
    ]
    columns = ["T", "precision", "AC", "tokens/s/GPU", "MFU %", "peak GiB", "plan GiB", "loss first -> last", "error"]
    title = (
        f"Training runs ({shape}, {seq_len} tokens/sequence, {steps} steps (the memory run {MEMORY_STEPS}), FSDP2 + "
        "compile + document masking)"
    )
    return {"title": title, "columns": columns, "rows": rows}


def result_json(checks: list[Check], runs: list[RunResult], *, meta: dict, date: str | None = None) -> dict:
    """The benchmarks/results/gpu_check.json document (the schema of benchmarks.report). meta: device, n_gpus,
    torch, commit, shape, seq_len, steps, command."""
    date = date or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    tables = [{"title": "Checks", "columns": ["check", "result", "detail"], "rows": []}]
    tables[0]["rows"] = [[c.name, verdict(c), c.detail] for c in checks]
    if runs:
        tables.append(_run_table(runs, meta["shape"], meta["seq_len"], meta["steps"]))
    return {
        "title": "GPU check: the fast path on CUDA",
        "order": 5,
        "command": meta.get("command", "bash scripts/gpu_check.sh"),
        "date": date,
        "machine": f"{meta['n_gpus']} x {meta['device']}, torch {meta['torch']}",
        "commit": meta["commit"],
        "summary": _summary(checks, runs, meta["shape"], meta["seq_len"]),
        "tables": tables,
        "notes": [
            "Written by `scripts/gpu_check.sh` (scripts/gpu_check.py, titanloop/checks/numerics.py); the tolerances "
            "and their derivation are in docs/scaling.md. MFU is against the device's bf16 dense peak, float8 runs "
            "included."
        ],
        "result": {**meta, "checks": [asdict(c) for c in checks], "runs": [asdict(r) for r in runs]},
    }


def write_json(path: Path, doc: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    os.replace(tmp, path)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python scripts/gpu_check.py", description=__doc__.split("\n")[0])
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence of the training runs (4096)")
    parser.add_argument("--steps", type=int, default=None, help=f"steps of each training run (default {STEPS})")
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per GPU per step (default 1)")
    parser.add_argument("--loops", default="4", help="T of the training runs (comma-separated; default 4)")
    parser.add_argument(
        "--precisions",
        default=",".join(RECIPES),
        help=f"training runs' precisions, a subset of {','.join(RECIPES)} (default all)",
    )
    parser.add_argument("--full", action="store_true", help="T = 4 and 8, the preemption and the learning runs")
    parser.add_argument("--learning", action="store_true", help="add the 1.4B learning run (about 3 minutes)")
    parser.add_argument(
        "--learning-args",
        default="",
        help='more trainer overrides for the learning run, e.g. --learning-args="--objective.beta 0.5" (checked '
        "against the config before anything runs; the verdict names them)",
    )
    parser.add_argument("--skip-train", action="store_true", help="no training runs (single-GPU checks only)")
    parser.add_argument("--skip-single", action="store_true", help="no in-process single-GPU checks")
    parser.add_argument(
        "--skip-kernel-choice", action="store_true", help="no kernel-choice run (its 2-step compiled torchrun)"
    )
    memory_run = f"bf16, T = 4, AC {MEMORY_AC}, {MEMORY_STEPS} steps, compiled and eager"
    parser.add_argument("--skip-memory-run", action="store_true", help=f"no memory runs ({memory_run})")
    parser.add_argument(
        "--preemption", action="store_true", help="add the preemption row (about 2 minutes; --full includes it)"
    )
    parser.add_argument("--shape", default=None, help="model preset (default: the largest that fits the GPU)")
    parser.add_argument("--gpus", type=int, default=None, help="with --write-plans: the GPU count to plan for")
    parser.add_argument("--plan-json", type=Path, help="memory plans computed ahead with --write-plans")
    parser.add_argument("--write-plans", type=Path, help="compute the training runs' memory plans (no GPU) and exit")
    parser.add_argument("--estimate", action="store_true", help="print each row's H100 time estimate and exit")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="seconds for the whole check: a row whose estimate (one H100) no longer fits is skipped (n/a), a run "
        "still going at the budget is stopped (default: no budget)",
    )
    parser.add_argument(
        "--workdir", type=Path, default=None, help="keep every run's directory and log here (default: a temporary one)"
    )
    parser.add_argument("--commit", default=None, help="the commit to record (default: git; a copy without .git)")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="no GPU: the whole orchestration on the CPU at tiny sizes (debug-tiny, 256 tokens, 3 steps, no "
        "single-GPU checks, no preemption row unless --preemption, which runs it as on the GPU: about 10 minutes on "
        "2 cores); its training numbers and verdicts mean nothing, the preemption row's do",
    )
    parser.add_argument("--out", type=Path, default=RESULT_JSON, help="result json (default %(default)s)")
    parser.add_argument("--no-json", action="store_true", help="print the table only")
    a = parser.parse_args(argv)
    a.seq_len = a.seq_len or (256 if a.smoke else 4096)
    a.steps = a.steps if a.steps is not None else (3 if a.smoke else STEPS)
    if a.smoke:
        a.shape, a.skip_single = a.shape or "debug-tiny", True
    try:
        a.loops = [4, 8] if a.full else [int(t) for t in a.loops.split(",")]
        assert all(t >= 1 for t in a.loops)
    except (ValueError, AssertionError):
        parser.error(f"--loops {a.loops!r}: expected comma-separated integers >= 1, e.g. --loops 4,8")
    a.precisions = a.precisions.split(",")
    bad = [p for p in a.precisions if p not in RECIPES]
    if bad:
        parser.error(f"--precisions: {bad} unknown, expected a subset of {','.join(RECIPES)}")
    if "bf16" not in a.precisions and not a.skip_train:
        parser.error("--precisions must include bf16: float8 runs are judged against the bf16 run")
    for flag, value in (("--steps", a.steps), ("--micro-batch", a.micro_batch), ("--seq-len", a.seq_len)):
        if value < 1:
            parser.error(f"{flag} {value}: expected an integer >= 1")
    if a.budget_s is not None and a.budget_s <= 0:
        parser.error(f"--budget-s {a.budget_s:g}: expected seconds > 0")
    if a.plan_json is not None and not a.plan_json.is_file():
        parser.error(f"--plan-json {a.plan_json}: no such file (write one with --write-plans FILE)")
    a.learning = a.learning or a.full
    a.learning_extra = shlex.split(a.learning_args)
    if a.learning_extra:
        if not a.learning:
            parser.error("--learning-args: add --learning (or --full), the run they are for")
        # the trainer's own parser (imported only here: the other options need none of it), so that a typo fails
        # now and not on the GPU after a minute of start-up
        from titanloop.train.config import load_config

        try:
            load_config(TRAIN_CONFIG, learning_args(Path("runs/learning"), 1, a.learning_extra), world_size=1)
        except ValueError as e:  # the trainer's ConfigError, one line saying what is wrong
            parser.error(f"--learning-args {a.learning_args!r}: {e}")
    a.preemption = a.preemption or (a.full and not a.smoke)  # --smoke --preemption: the row on the CPU (~10 min)
    return a


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--record-kernels"]:  # inside a torchrun worker (see _check_kernel_choice)
        return record_kernels_main(argv[1], argv[2:])
    a = parse_args(argv)
    if a.write_plans or a.estimate:
        a.name, a.overrides, a.n_gpus = a.shape or SHAPES[0][0], {}, a.gpus or 1
        return write_plans(a) if a.write_plans else print_estimate(a)
    message = None if a.smoke else no_cuda_message()
    if message:
        print(message)
        return 1
    import torch

    a.cuda = not a.smoke
    if a.cuda:
        a.n_gpus = torch.cuda.device_count()
        device = torch.cuda.get_device_name(0)
        a.free_bytes = min(torch.cuda.mem_get_info(i)[0] for i in range(a.n_gpus))
    else:
        a.n_gpus, device, a.free_bytes = 1, "CPU (smoke run: tiny shapes, numbers meaningless)", None
    a.name, a.overrides = (a.shape, {}) if a.shape else pick_model(a.free_bytes, a.n_gpus)
    a.shape_text = a.name + "".join(f" {k}={v}" for k, v in a.overrides.items())
    a.peak = peak_flops(device) if a.cuda else None
    a.budget = Budget(a.budget_s)
    exit_on_sigterm()  # a part stopped by gpu_session stops its run on the way out
    plans = json.loads(a.plan_json.read_text()) if a.plan_json else {}
    meta = {"device": device, "n_gpus": a.n_gpus, "torch": torch.__version__, "commit": a.commit or git_commit()}
    meta.update(shape=a.shape_text, seq_len=a.seq_len, steps=a.steps, command=" ".join(["python", *sys.argv]))
    if a.budget_s is not None:
        meta["budget_s"] = a.budget_s
    checks: list[Check] = []
    runs: list[RunResult] = []

    def emit(new: list[Check], printed: bool = False) -> None:
        """Print the new rows and rewrite the json: a call stopped from outside still leaves what it finished."""
        checks.extend(new)
        for c in [] if printed else new:
            print(format_table([c]).splitlines()[-1], flush=True)
        if not a.no_json:
            meta["seconds"] = round(time.monotonic() - a.budget.start, 1)
            write_json(a.out, result_json(checks, runs, meta=meta))

    free = "" if a.free_bytes is None else f", smallest free memory {a.free_bytes / GIB:.1f} GiB"
    print(f"gpu_check: {a.n_gpus} x {device}{free}, torch {torch.__version__}, {a.shape_text}", flush=True)
    with contextlib.ExitStack() as stack:
        if a.workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gpu_check_")))
        else:
            workdir = a.workdir
            workdir.mkdir(parents=True, exist_ok=True)
        if not a.skip_single:
            skip = a.budget.skip_reason(SINGLE_CHECKS_S)
            emit([Check("single-GPU checks", None, skip)] if skip else _single_gpu_checks(), printed=not skip)
        if not a.skip_kernel_choice:
            emit([_check_kernel_choice(a, workdir)])
        for spec in [] if a.skip_train else training_runs(a):
            res, rows = _train(a, spec, workdir, plans)
            runs.append(res)
            emit(rows)
        emit(float8_checks(runs))
        if a.preemption:
            emit([_check_preemption(a, workdir)])
        if a.learning:
            emit([_check_learning(a, workdir)])
    print(format_table(checks))
    if not a.no_json:
        print(f"wrote {a.out}")
    return exit_status(checks)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    code = main()
    if sys.argv[1:2] == ["--record-kernels"]:
        from titanloop.train.process_exit import exit_without_teardown

        exit_without_teardown(code)  # as titanloop.train leaves (its native threads may abort a normal teardown)
    sys.exit(code)
