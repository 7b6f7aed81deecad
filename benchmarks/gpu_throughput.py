"""`python benchmarks/gpu_throughput.py`: titanloop's training throughput on one GPU, in one call of <= 8 minutes.

Three parts, each through a real entry point (`torchrun -m titanloop.train` with overrides of
train_configs/debug.toml, built by scripts/gpu_check.py's `train_args`; torchtitan's own `torchtitan.train.main`):

 1. The matrix at the Ouro-1.4B shape (`--model.preset ouro-1.4b`, vocab 49152, 4096 tokens/sequence, T = 4, FSDP2
    world 1, compile, document masking): sequences per step (micro-batch) x activation-checkpoint policy
    (`--parallelism.activation_checkpoint`, and per-loop AC keeping its first loops, `--parallelism.ac_kept_loops`)
    x precision (`--float8.recipe off|tensorwise|rowwise`), the shipped setting accumulating two micro-batches per
    step (`--training.global_batch_size`, as every stage config accumulates), then T = 8 for the fastest T = 4
    setting whose AC holds no more loops at T = 8 (per-loop or per-layer AC: without AC or with selective AC, T = 8
    at 4K does not fit one 80 GB GPU). Each row:
    tokens/s/GPU (median over the logged steps after the warm-up, from metrics.jsonl, with `--metrics.breakdown
    false` so that the step timer adds no barriers), MFU (the trainer's own `mfu`, every loop counted), peak GiB
    (`max_mem_gib`), or why there is no number: out of memory (a row, not a crash), a value this trainer does not
    accept (checked with titanloop.train.config.load_config before launching, e.g. an AC policy or
    `--optimizer.implementation` not yet there), the time budget, a failure.
 2. A profile: the first row (the shipped setting) runs 2 more steps under `--profiling.enable true` (titanloop's
    torch.profiler callback; those steps are left out of its throughput). The chrome trace is summarized here
    (top CUDA kernels by total time; share of the GPU timeline in GEMM / attention / elementwise / NCCL /
    memory copies / other, and idle) and kept, gzipped, in --artifacts. The first row's float8 twins (same
    sequences, AC and T) are profiled too, and each is set against it kernel by kernel (float8_vs_bf16): per step,
    the time in each category and idle, the kernels only float8 has (its GEMMs; torchao's casts and scales), the
    kernels that grew most, and one sentence saying where float8 gains and loses time. `--compare-traces` does the
    same for two kept traces without running anything.
 3. Looped vs dense at equal FLOPs per token: titanloop with 6 shared layers x T = 4 against a dense Llama-style
    model of the same width (hidden 2048, 16 heads MHA, FFN 5632, vocab 49152) trained by torchtitan's own trainer
    and llama3 model (benchmarks/torchtitan_dense.py, the harness), with as many layers as make its FLOPs per
    token (titanloop's count, LoopLMConfig.flops_per_token, over the data's documents) closest to the looped
    model's; the full 24 x 4 = 96 layers do not fit one H100 with AdamW. Same sequence length, sequences per
    step, bf16 compute with fp32 master weights and reduction, compile, no activation checkpointing, the same
    synthetic documents. If the torchtitan run fails, titanloop's own trainer at T = 1 with those layers (a dense
    model) is the fallback baseline (always run with --full and --smoke). The pair is launched twice
    (--compare-launches; the second pair after the float8 twins): each pair's ratio is reported and their median
    judged, as one launch of a shape can run 20% slower than another (issue 35).

The result is benchmarks/results/gpu_throughput.json (benchmarks/report.py schema: `python -m benchmarks.report`
renders it into BENCHMARKS.md), with targets: MFU >= 0.40 for bf16 at T = 4 in the shipped setting
(train_configs/ouro_1p4b.toml's sequences per step and AC policy), float8 / bf16 tokens/s >= 1.15, looped / dense
>= 1.0 (the median of the pairs' ratios). `--plan` prints the launches in order and where the default budget ends
by the estimates: the launches the targets need come before that mark, the rest run if time is left.

    # one call on the GPU machine, with the wheels of shared/GPU.md downloaded into .whl/ beforehand (the json has
    # to name the commit: the machine's copy of the checkout has no .git; the results come back through $OUT):
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
      && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 WANDB_MODE=offline \
      && python3 benchmarks/gpu_throughput.py --artifacts "$OUT" --commit <HEAD>   # default matrix, <= 8 minutes
    python3 benchmarks/gpu_throughput.py --full                 # every micro-batch x AC x precision (~40 min)
    python3 benchmarks/gpu_throughput.py --setting 2:loop:off --setting 4:loop:tensorwise:8   # chosen rows
    python benchmarks/gpu_throughput.py --plan                 # the plan and its time estimate (no GPU needed)
    python benchmarks/gpu_throughput.py --smoke --out /tmp/g.json   # CPU: the whole pipeline at tiny sizes
    python benchmarks/gpu_throughput.py --compare-traces BF16.json.gz FLOAT8.json.gz   # two kept traces, no run

Rows run in priority order (the shipped setting and the comparison first); a row whose estimate (scaled by how
much slower than estimated the runs so far were) no longer fits --budget-s is reported as skipped, and a run is
stopped at the budget, so one call does not overrun. --artifacts receives every run's log, the gzipped trace and a
copy of the json. Without CUDA (and without --smoke or --plan) it
prints one line and exits 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gzip
import importlib.util
import itertools
import json
import os
import re
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's titanloop and benchmarks, when run as a script

from benchmarks.report import measured_commit  # noqa: E402
from benchmarks.torchtitan_dense import SPEC_ENV, DenseSpec  # noqa: E402
from titanloop.model.config import LoopLMConfig, attended_keys_per_token, preset  # noqa: E402
from titanloop.parallel.activation_checkpoint import live_loops  # noqa: E402
from titanloop.train.config import load_config  # noqa: E402


def _load_gpu_check():
    """scripts/gpu_check.py (not a package) as a module: its training-run helpers are reused here."""
    name = "gpu_check_script"  # the name tests/test_gpu_check.py loads it under (its dataclasses look it up there)
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / "gpu_check.py")
        module = sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules[name]


gpu_check = _load_gpu_check()

SCRIPT = Path(__file__).resolve()
RESULT_JSON = ROOT / "benchmarks" / "results" / "gpu_throughput.json"
DEFAULT_ARTIFACTS = ROOT / "benchmark_results" / "gpu_throughput"
PRECISIONS = ("off", "tensorwise", "rowwise")  # --float8.recipe
MICRO_BATCHES = (1, 2, 4)
# --parallelism.activation_checkpoint values to try; those the trainer does not accept (yet) become skipped rows
AC_POLICIES = ("none", "layer", "loop", "selective", "auto")
# The shipped setting is train_configs/ouro_1p4b.toml's sequences per step and AC policy, read from it (the stage
# configs choose their own AC at their sbatch size, docs/parallelism.md; one GPU holds the whole optimizer state).
SHIPPED_CONFIG = ROOT / "train_configs" / "ouro_1p4b.toml"
_shipped = load_config(SHIPPED_CONFIG, [])
SHIPPED_MB, SHIPPED_AC = _shipped.training.micro_batch_size, _shipped.parallelism.activation_checkpoint
SEQ_LEN, VOCAB, PRESET = 4096, 49152, "ouro-1.4b"
LOOPED_LAYERS, COMPARE_MB, COMPARE_AC = 6, 2, "none"  # looped vs dense: 6 shared layers x T = 4, 2 x 4K, no AC
# Launches of the looped-vs-dense pair: one pair gave 1.009 at 474e7ab, closer to 1.0 than issue 35's report of one
# shape's launches wandering by 20% (7,618 vs 6,237 tokens/s); the summary judges the median of the pairs' ratios
COMPARE_LAUNCHES = 2

# ----- the time model of one call (H100; shared/GPU.md, measured at c79621e) ----------------------------------------
CALL_S = 480  # one GPU call, wheels included
INSTALL_S = 15  # installing the wheels (seconds there) and copying the results out
BUDGET_S = CALL_S - INSTALL_S - 15  # this script's own budget by default (15 s to spare)
RUN_OVERHEAD_S = 30.0  # one torchrun: start, imports, process group, build + init 1.4B, first-step compile (~10 s)
FLOAT8_OVERHEAD_S = 5.0  # float8 conversion and its larger graphs
DENSE_OVERHEAD_S = 75.0  # torchtitan: the same, + its FlexAttention compile (max_autotune, coordinate descent)
# two profiled steps: the profiler, exporting and summarizing the chrome trace. At 474e7ab the profiled per-loop
# row spent 23.8 s besides its steps against 24.3 s for the unprofiled kept-2 row (gpu_throughput.json): the export
# is within the noise of the start-up; 5 s is kept for float8's larger traces
PROFILE_EXPORT_S = 5.0
STEP_S = 0.53  # 1.4B, T = 4, 1 x 4K, bf16, per-loop AC: 0.53 s (7,380-7,618 tokens/s)
AC_STEP_FACTOR = {"none": 0.88, "layer": 1.0, "loop": 1.0, "selective": 0.8, "auto": 1.0}  # none: 8,564 tokens/s;
# selective: 12,866 against 9,991 for per loop at 2 x 4K (474e7ab)
PRECISION_STEP_FACTOR = {"off": 1.0, "tensorwise": 1.2, "rowwise": 1.25}  # 0.84x and 0.81x of bf16
STEPS, WARMUP = 8, 3  # steps per row; the first WARMUP (compile, allocator, autotuning) are not measured
PROFILE_STEPS = 2  # a profiled row runs this many more steps under the profiler (left out of its throughput)
SMOKE_STEPS, SMOKE_WARMUP = 4, 1
GIB = 1024**3
OOM_PATTERNS = ("OutOfMemoryError", "CUDA out of memory", "CUDA error: out of memory", "CUBLAS_STATUS_ALLOC_FAILED")


@dataclass(frozen=True)
class Setting:
    """One row of the matrix: overrides of the trainer's config (data-driven: add a Setting to add a row)."""

    micro_batch: int  # sequences per forward-backward (world 1: per step, unless extra sets GLOBAL_BATCH)
    ac: str  # --parallelism.activation_checkpoint
    precision: str = "off"  # --float8.recipe
    n_loops: int = 4  # --loop_sampler.n_loops
    extra: tuple[
        tuple[str, str], ...
    ] = ()  # further --key value overrides, e.g. (("optimizer.implementation", "fused"),)
    inject_oom: bool = False  # smoke/test only: the run raises torch.OutOfMemoryError at step 2

    @property
    def label(self) -> str:
        prec = "bf16" if self.precision == "off" else f"float8 {self.precision}"
        extra = "".join(f", {k.split('.')[-1]}={v}" for k, v in self.extra)
        return f"T={self.n_loops} {self.micro_batch} seq, AC {self.ac}, {prec}{extra}" + (
            " (injected OOM)" if self.inject_oom else ""
        )

    @property
    def sequences_per_step(self) -> int:
        """Sequences per optimizer step (world 1): the micro-batch, times the micro-batches accumulated when `extra`
        sets training.global_batch_size."""
        return int(dict(self.extra).get(GLOBAL_BATCH, self.micro_batch))

    def overrides(self) -> list[str]:
        """What this setting adds to the base arguments (float8 goes through train_args' precision)."""
        args = ["--parallelism.activation_checkpoint", self.ac]
        for key, value in self.extra:
            args += [f"--{key}", value]
        return args


SHIPPED = Setting(SHIPPED_MB, SHIPPED_AC)
# per-loop AC that keeps the first k loops (parallelism.ac_kept_loops): recomputes T - k loops
KEPT_LOOPS = "parallelism.ac_kept_loops"
# sequences per step; twice the micro-batch accumulates two micro-batches per step, as every stage config does
GLOBAL_BATCH = "training.global_batch_size"
# The default matrix, in priority order (each row's estimate must fit what is left of --budget-s): issue 35's
# targets first (the shipped setting and its float8 twins, tensorwise and rowwise; build_plan puts the looped-vs-dense
# pairs around the twins), then the shipped setting accumulating two micro-batches per step as the configs do (its
# plan holds the fp32 gradients through the second micro-batch: 63.9 GiB against 58.6; no other row accumulates),
# then the other AC policies that fit 2 x 4K at T = 4 on one H100 (measured at 474e7ab: per loop 34.8 GiB, selective
# 58.6, 2 of 4 loops kept 60.6; none plans 72.6 GB eager, too close to 80 GB to try), which the budget may skip: the
# rows up to the accumulating one fit it (tests/test_benchmarks_gpu_throughput.py), the rest run if time is left.
DEFAULT_MATRIX = [
    SHIPPED,
    Setting(SHIPPED_MB, SHIPPED_AC, "tensorwise"),
    Setting(SHIPPED_MB, SHIPPED_AC, "rowwise"),
    Setting(SHIPPED_MB, SHIPPED_AC, extra=((GLOBAL_BATCH, str(2 * SHIPPED_MB)),)),
    *(Setting(SHIPPED_MB, ac) for ac in ("selective", "loop") if ac != SHIPPED_AC),
    Setting(SHIPPED_MB, "loop", extra=((KEPT_LOOPS, "2"),)),
]
# --full: every micro-batch x AC policy x precision, and both optimizer implementations (where the trainer has them)
FULL_MATRIX = [SHIPPED] + [
    s
    for s in (Setting(mb, ac, p) for p, mb, ac in itertools.product(PRECISIONS, MICRO_BATCHES, AC_POLICIES))
    if s != SHIPPED
]
FULL_MATRIX += [Setting(SHIPPED_MB, SHIPPED_AC, extra=(("optimizer.implementation", i),)) for i in ("foreach", "fused")]
FULL_MATRIX += [Setting(SHIPPED_MB, "loop", extra=((KEPT_LOOPS, str(k)),)) for k in (1, 2, 3)]
SMOKE_MATRIX = [
    SHIPPED,
    Setting(SHIPPED_MB, SHIPPED_AC, "tensorwise"),  # profiled: float8 against bf16 from the traces (emulated here)
    Setting(1, "loop"),  # a T = 8 candidate
    Setting(1, "none", inject_oom=True),
    Setting(1, "no-such-policy"),
]


@dataclass
class Row:
    """One training run's outcome (titanloop or torchtitan)."""

    label: str
    trainer: str  # titanloop | torchtitan
    n_loops: int
    micro_batch: int
    ac: str
    precision: str
    status: str  # ok | oom | unsupported | budget | failed | timeout
    reason: str = ""
    tokens_per_s_gpu: float | None = None
    mfu: float | None = None  # the trainer's own (torchtitan: its count of FLOPs)
    tflops: float | None = None
    peak_gib: float | None = None
    step_s: float | None = None
    steps_measured: int = 0
    wall_s: float = 0.0
    estimate_s: float = 0.0
    run_dir: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass
class Job:
    """One launch of the plan: a titanloop row (matrix, T = 8, looped, dense T = 1) or the torchtitan dense run."""

    role: str  # matrix | t8 | looped | dense | titanloop_dense
    setting: Setting
    model_overrides: dict = field(default_factory=dict)
    profile: bool = False
    estimate_s: float = 0.0
    launch: int = 1  # which launch of the looped-vs-dense pair (COMPARE_LAUNCHES)


def job_record(job: Job) -> dict:
    """How the json records a run's job (its "job" field); job_from_record reads it back."""
    return {
        "role": job.role,
        "setting": dataclasses.asdict(job.setting),
        "model_overrides": job.model_overrides,
        "profile": job.profile,
        "launch": job.launch,
    }


def job_from_record(rec: dict) -> Job:
    """The Job a json's run recorded with job_record (its estimate is not recorded: 0)."""
    setting = {**rec["setting"], "extra": tuple(tuple(kv) for kv in rec["setting"].get("extra", ()))}
    overrides = dict(rec.get("model_overrides") or {})
    return Job(rec["role"], Setting(**setting), overrides, rec["profile"], launch=rec.get("launch", 1))


@dataclass
class Context:
    """Where and at what size the plan runs (the Ouro-1.4B shape on a GPU; tiny shapes for --smoke)."""

    smoke: bool
    preset: str
    seq_len: int
    vocab: int
    steps: int
    warmup: int
    compile: bool
    n_gpus: int = 1
    cuda: bool = False
    peak_flops: float | None = None  # bf16 dense peak of the GPU (gpu_check.peak_flops), for MFU by titanloop's count
    workdir: Path = Path(".")
    artifacts: Path = DEFAULT_ARTIFACTS
    budget_s: float | None = BUDGET_S
    dense_attention: str = "flex"
    dense_cuda_graphs: bool = False
    python: str = sys.executable
    launches: int = 0  # runs started so far (names their directories)

    def shape(self, model_overrides: dict | None = None, n_loops: int = 4) -> LoopLMConfig:
        return preset(self.preset, vocab_size=self.vocab, n_loops=n_loops, **(model_overrides or {}))


def gpu_context(**kw) -> Context:
    return Context(
        smoke=False, preset=PRESET, seq_len=SEQ_LEN, vocab=VOCAB, steps=STEPS, warmup=WARMUP, compile=True, **kw
    )


def smoke_context(**kw) -> Context:
    kw.setdefault("budget_s", None)
    kw.setdefault("dense_attention", "sdpa")  # FlexAttention has no backward on CPU
    return Context(
        smoke=True,
        preset="debug-tiny",
        seq_len=64,
        vocab=512,
        steps=SMOKE_STEPS,
        warmup=SMOKE_WARMUP,
        compile=False,
        **kw,
    )


# ----- pure arithmetic (unit-tested) ---------------------------------------------------------------------------------
def median_throughput(rows: list[dict], warmup: int, exclude: set[int] = frozenset(), n_gpus: int = 1) -> dict:
    """Medians over a titanloop run's metrics.jsonl rows after the warm-up (steps > warmup, not in `exclude`):
    tokens/s/GPU, the trainer's MFU (None when any row has none, e.g. on CPU) and TFLOP/s, step seconds; peak GiB
    is the largest max_mem_gib of any row (None when not logged: CPU)."""
    used = [r for r in rows if r["step"] > warmup and r["step"] not in exclude and "tokens_per_s" in r]
    if not used:
        raise ValueError(f"no logged step after the warm-up ({warmup} steps) to measure ({len(rows)} rows logged)")
    tok = [r["tokens_per_s"] for r in used]
    mfus = [r.get("mfu") for r in used]
    peaks = [r["max_mem_gib"] for r in rows if r.get("max_mem_gib") is not None]
    return {
        "tokens_per_s_gpu": statistics.median(tok) / n_gpus,
        "mfu": None if any(m is None for m in mfus) else statistics.median(mfus),
        "tflops": statistics.median(r["tflops"] for r in used) if all("tflops" in r for r in used) else None,
        "peak_gib": max(peaks) if peaks else None,
        "steps_measured": len(used),
    }


def dense_throughput(rows: list[dict], warmup: int) -> dict:
    """The same medians over torchtitan's logged steps (the harness's JSONL of its MetricsProcessor): tps is per
    device, mfu(%) is torchtitan's (its FLOP count, its peak), memory its max active GiB per log interval."""
    used = [r for r in rows if r["step"] > warmup and "throughput(tps)" in r]
    if not used:
        raise ValueError(f"no logged step after the warm-up ({warmup} steps) to measure ({len(rows)} rows logged)")
    mfus = [r.get("mfu(%)") for r in used]
    peaks = [r["memory/max_active(GiB)"] for r in rows if r.get("memory/max_active(GiB)", 0) > 0]
    return {
        "tokens_per_s_gpu": statistics.median(r["throughput(tps)"] for r in used),
        "mfu": None if any(m is None for m in mfus) else statistics.median(mfus) / 100,
        "tflops": statistics.median(r["tflops"] for r in used),
        "peak_gib": max(peaks) if peaks else None,
        "steps_measured": len(used),
        "torchtitan_flops_per_token": used[-1].get("num_flops_per_token"),
        "torchtitan_peak_flops": used[-1].get("gpu_peak_flops"),
    }


def is_oom(returncode: int | None, output: str) -> bool:
    """A failed run that ran out of device memory (PyTorch's OutOfMemoryError or CUDA's/cuBLAS's own message)."""
    return returncode not in (0, None) and any(p in output for p in OOM_PATTERNS)


def failure_reason(output: str, returncode: int | None) -> str:
    """One line for a failed run: the last exception line of its output (the worker's, not torchrun's summary)."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for line in reversed(lines):
        text = re.sub(r"^\[rank\d+\]:\s*", "", line)
        if re.match(r"^[\w.]*(Error|Exception)\b", text) and "ChildFailedError" not in text:
            return f"exit {returncode}: {text}"[:240]
    return f"exit {returncode}: {lines[-1][:200] if lines else 'no output'}"


def step_estimate_s(ctx: Context, s: Setting, model_overrides: dict | None = None) -> float:
    """Seconds of one training step on the H100 from the measured 1.4B, T = 4, 1 x 4K step (STEP_S), scaled by
    FLOPs per token (titanloop's count), sequences, the AC policy and precision (linear in sequences: an upper
    bound, larger batches run more efficiently)."""
    ref = preset(PRESET).flops_per_token(SEQ_LEN, n_loops=4)
    flops = ctx.shape(model_overrides, s.n_loops).flops_per_token(ctx.seq_len, n_loops=s.n_loops)
    return (
        STEP_S
        * flops
        / ref
        * s.sequences_per_step
        * ctx.seq_len
        / SEQ_LEN
        * AC_STEP_FACTOR.get(s.ac, 1.0)
        * PRECISION_STEP_FACTOR.get(s.precision, 1.0)
    )


def job_estimate_s(ctx: Context, job: Job) -> float:
    """One launch on the H100: start-up and compile, then its steps (a profiled job runs 2 more and exports)."""
    steps = ctx.steps + (PROFILE_STEPS if job.profile else 0)
    overhead = DENSE_OVERHEAD_S if job.role == "dense" else RUN_OVERHEAD_S
    if job.setting.precision != "off":
        overhead += FLOAT8_OVERHEAD_S
    return (
        overhead
        + steps * step_estimate_s(ctx, job.setting, job.model_overrides)
        + (PROFILE_EXPORT_S if job.profile else 0.0)
    )


def plan_estimate_s(ctx: Context, jobs: list[Job]) -> float:
    """The plan's seconds on the H100, with the T = 8 row (chosen at run time) as the costliest candidate at T = 8."""
    t8 = [dataclasses.replace(j.setting, n_loops=8) for j in jobs if t8_candidate(j)]
    worst_t8 = max((job_estimate_s(ctx, Job("t8", s)) for s in t8), default=0.0)
    return sum(job_estimate_s(ctx, j) for j in jobs) + worst_t8


def dense_layers_for(looped: LoopLMConfig, seq_len: int, n_loops: int, doc_lengths=None) -> int:
    """The layer count of a dense model of the looped model's width (T = 1, one readout) whose FLOPs per token
    (titanloop's count) are closest to the looped model's at T = n_loops."""
    target = looped.flops_per_token(seq_len, n_loops=n_loops, doc_lengths=doc_lengths)

    def dense(n: int) -> float:
        return looped.replace(n_layers=n, n_loops=1).flops_per_token(seq_len, n_loops=1, doc_lengths=doc_lengths)

    return min(range(1, 4 * looped.n_layers * n_loops + 1), key=lambda n: abs(dense(n) - target))


def synthetic_doc_lengths(seq_len: int, vocab: int, rows: int = 32, seed: int = 0) -> list[int]:
    """Document lengths of the first `rows` rows of titanloop's synthetic_text stream as the runs here configure it
    (gpu_check's motif vocabulary): the attention part of FLOPs per token depends on them."""
    import numpy as np

    from titanloop.data.synthetic_text import SyntheticTextSource

    source, lengths = SyntheticTextSource(seq_len, vocab, seed, motif_vocab=gpu_check.MOTIF_VOCAB), []
    for k in range(rows):
        doc_ids = source.row(k).doc_ids[:seq_len]
        lengths += [int(n) for n in np.unique(doc_ids, return_counts=True)[1]]
    return lengths


# ----- the profile's chrome trace -------------------------------------------------------------------------------------
CATEGORIES = ("gemm", "attention", "elementwise", "nccl", "memory", "other")
_NCCL = re.compile(r"nccl|c10d::|gloo|all_?reduce|all_?gather|reduce_?scatter|broadcast", re.I)
_ATTENTION = re.compile(r"flash|fmha|attention|attn|flex|varlen|sdpa|mha", re.I)
_GEMM = re.compile(
    r"gemm|matmul|cutlass|xmma|nvjet|cublas|wgmma|scaled_mm|fused_(add)?mm|(add|b)?mmbackward|(^|[^a-z])(mm|addmm|bmm|baddbmm|linear)([^a-z]|$)",
    re.I,
)
_MEMORY = re.compile(r"memcpy|memset", re.I)
_ELEMENTWISE = re.compile(
    r"elementwise|vectorized|unrolled|triton_(poi|red|per)|reduce|norm|softmax|multi_tensor|foreach|adam|copy|fill|"
    r"cat|index|embedding|cross_entropy|loss|aten::|where|mul|add|exp|silu|gelu|rope|rotary|sum|mean",
    re.I,
)


def kernel_category(name: str, cat: str = "kernel") -> str:
    """gemm | attention | elementwise | nccl | memory | other, from a kernel's (or CPU operator's) name."""
    if cat in ("gpu_memcpy", "gpu_memset") or _MEMORY.search(name):
        return "memory"
    if _NCCL.search(name):
        return "nccl"
    if _ATTENTION.search(name):
        return "attention"
    if _GEMM.search(name):
        return "gemm"
    if _ELEMENTWISE.search(name):
        return "elementwise"
    return "other"


def _outermost(events: list[dict]) -> list[dict]:
    """CPU operators not nested inside another operator of the same thread."""
    out = []
    for _, group in itertools.groupby(
        sorted(events, key=lambda e: (e.get("tid"), e["ts"])), key=lambda e: e.get("tid")
    ):
        end = float("-inf")
        for e in group:
            if e["ts"] >= end:
                out.append(e)
                end = e["ts"] + e["dur"]
    return out


def _union(intervals: list[tuple[float, float]]) -> float:
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    return total + (cur_end - cur_start if cur_end is not None else 0.0)


def _device_events(trace: dict) -> tuple[list[dict], str]:
    """(the trace's device events, "cuda"), or without CUDA events (a CPU run) its outermost CPU operators standing
    in for kernels, "cpu_op"."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e and "ts" in e]
    device = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    source = "cuda"
    if not device:
        device, source = _outermost([e for e in events if e.get("cat") == "cpu_op"]), "cpu_op"
    if not device:
        raise ValueError("the trace has no CUDA kernels and no CPU operators")
    return device, source


def _totals(device: list[dict], key=lambda name: name) -> dict[str, list]:
    """{key(kernel name): [calls, total us, category]} over device events (the category of the first of a key's)."""
    out: dict[str, list] = {}
    for e in device:
        name = e.get("name", "?")
        rec = out.setdefault(key(name), [0, 0.0, kernel_category(name, e.get("cat", ""))])
        rec[0] += 1
        rec[1] += e["dur"]
    return out


def summarize_trace(trace: dict, top: int = 15) -> dict:
    """A torch.profiler chrome trace in numbers: the device timeline (CUDA kernels, memcpy/memset) from the first
    to the last event, its busy time (union of events over streams), each category's total time as a share of the
    timeline, idle = 1 - busy / timeline, and the `top` kernels by total time. Without CUDA events (a CPU run) the
    outermost CPU operators stand in for kernels (smoke runs only). Streams overlap (NCCL with compute), so the
    category shares may add up to more than the busy share."""
    device, source = _device_events(trace)
    start = min(e["ts"] for e in device)
    span = max(e["ts"] + e["dur"] for e in device) - start
    busy = _union([(e["ts"], e["ts"] + e["dur"]) for e in device])
    by_name = _totals(device)
    by_cat = dict.fromkeys(CATEGORIES, 0.0)
    for _, d, c in by_name.values():
        by_cat[c] += d
    total = sum(by_cat.values())
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    return {
        "source": source,
        "events": len(device),
        "span_ms": span / 1e3,
        "busy_ms": busy / 1e3,
        "shares": {**{c: v / span for c, v in by_cat.items()}, "idle": 1 - busy / span},
        "top": [
            {"name": n, "category": c, "calls": k, "total_ms": d / 1e3, "share_of_kernel_time": d / total}
            for n, (k, d, c) in ranked
        ],
    }


# ----- launching runs -------------------------------------------------------------------------------------------------
def kernel_stem(name: str) -> str:
    """A kernel's name without the index Inductor appends to a generated kernel (triton_poi_fused_mul_silu_4 ->
    triton_poi_fused_mul_silu), so that the same fused kernel matches across two runs' traces."""
    return re.sub(r"_\d+$", "", name) if name.startswith(("triton_", "cpp_fused")) else name


def kernel_totals(trace: dict) -> dict[str, list]:
    """{kernel stem: [calls, total us, category]} over a trace's device events (kernel_stem, _device_events)."""
    return _totals(_device_events(trace)[0], kernel_stem)


def float8_vs_bf16(bf16_trace: dict, float8_trace: dict, steps: int = PROFILE_STEPS, top: int = 10) -> dict:
    """Where float8's step time goes against bf16's, from the two rows' profiles of `steps` steps each: per step,
    each category's kernel time (GEMM, attention, elementwise, ...), idle (the timeline less its busy union) and the
    timeline itself; the kernels only the float8 trace has (its float8 GEMMs and the casts, scales and transposes
    torchao adds), split into GEMM and the rest; the `top` kernels whose time grew most; and a sentence saying
    which of them makes float8 slower or faster. Kernels are matched by kernel_stem."""
    per = 1e3 * steps  # us over the trace -> ms per step
    sums = {"bf16": summarize_trace(bf16_trace), "float8": summarize_trace(float8_trace)}
    totals = {"bf16": kernel_totals(bf16_trace), "float8": kernel_totals(float8_trace)}
    # each category's (and idle's) share of the timeline, as ms per step; then the timeline itself
    ms = {k: {c: v * sm["span_ms"] / steps for c, v in sm["shares"].items()} for k, sm in sums.items()}
    for k, sm in sums.items():
        ms[k]["timeline"] = sm["span_ms"] / steps
    rows = [[c, ms["bf16"][c], ms["float8"][c], ms["float8"][c] - ms["bf16"][c]] for c in ms["bf16"]]
    only = {n: v for n, v in totals["float8"].items() if n not in totals["bf16"]}
    new_gemm = sum(us for _, us, c in only.values() if c == "gemm") / per
    new_other = sum(us for _, us, c in only.values() if c != "gemm") / per
    stems = set(totals["bf16"]) | set(totals["float8"])

    def t(k, n):
        return totals[k].get(n, [0, 0.0, None])

    grown = sorted(stems, key=lambda n: t("bf16", n)[1] - t("float8", n)[1])[:top]
    growth = [
        {
            "kernel": n,
            "category": t("float8", n)[2] or t("bf16", n)[2],
            "bf16_ms": t("bf16", n)[1] / per,
            "float8_ms": t("float8", n)[1] / per,
            "delta_ms": (t("float8", n)[1] - t("bf16", n)[1]) / per,
            "float8_calls_per_step": t("float8", n)[0] / steps,
        }
        for n in grown
        if t("float8", n)[1] > t("bf16", n)[1]
    ]
    b, f = ms["bf16"], ms["float8"]
    d_gemm = f["gemm"] - b["gemm"]
    d_kernels = sum(f[c] - b[c] for c in CATEGORIES if c != "gemm")
    d_rest = d_kernels + f["idle"] - b["idle"]
    gemm_words = (
        f"its GEMMs take {-d_gemm:.1f} ms less ({b['gemm']:.1f} -> {f['gemm']:.1f})"
        if d_gemm < 0
        else f"its GEMMs take {d_gemm:.1f} ms MORE ({b['gemm']:.1f} -> {f['gemm']:.1f}): the float8 GEMMs are no faster"
    )
    verdict = "slower" if f["timeline"] > b["timeline"] else "faster"
    explanation = (
        f"Per step, float8 takes {f['timeline']:.1f} ms against bf16's {b['timeline']:.1f} ({verdict}): {gemm_words}; "
        f"everything else takes {d_rest:+.1f} ms (non-GEMM kernels "
        f"{d_kernels:+.1f}, idle {f['idle'] - b['idle']:+.1f}), of which "
        f"{new_other:.1f} ms are kernels the bf16 trace has not got (casts, scales, transposes: "
        f"{sum(1 for v in only.values() if v[2] != 'gemm')} kinds)."
    )
    return {
        "steps": steps,
        "source": sums["float8"]["source"],
        "ms_per_step": rows,  # [category | idle | timeline, bf16, float8, float8 - bf16]
        "float8_only_ms": {"gemm": new_gemm, "other": new_other},
        "float8_only_kernels": len(only),
        "growth": growth,
        "explanation": explanation,
    }


def read_trace(path: Path) -> dict:
    """A chrome trace, gzipped (as --artifacts keeps it) or not."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def no_cuda_message() -> str | None:
    import torch

    if torch.cuda.is_available():
        return None
    return (
        "gpu_throughput: no CUDA device (torch.cuda.is_available() is False): run it on a GPU machine, or use "
        "--smoke (the pipeline at tiny sizes on CPU) or --plan (the plan and its time estimate)"
    )


def titanloop_args(ctx: Context, job: Job, run_dir: Path) -> tuple[list[str], list[str]]:
    """(base, setting) overrides of train_configs/debug.toml for a titanloop job: gpu_check's training run
    (train_args), every step logged, no step-timer barriers; the setting's own overrides apart, so that a value the
    trainer refuses can be told from a broken base."""
    s = job.setting
    steps = ctx.steps + (PROFILE_STEPS if job.profile else 0)
    precision = "bf16" if s.precision == "off" else s.precision
    base = gpu_check.train_args(
        run_dir, ctx.preset, job.model_overrides, s.n_loops, ctx.seq_len, ctx.n_gpus, precision, steps, s.micro_batch
    )
    base += ["--metrics.log_freq", "1", "--metrics.breakdown", "false", "--model.vocab_size", str(ctx.vocab)]
    base += ["--lr_scheduler.warmup_steps", "2", "--parallelism.compile", str(ctx.compile).lower()]
    if job.profile:
        base += ["--profiling.enable", "true", "--profiling.start_step", str(ctx.steps + 1)]
        base += ["--profiling.steps", str(PROFILE_STEPS)]
        base += ["--profiling.memory_snapshot", "false"]
    return base, s.overrides()


def check_accepted(base: list[str], setting_args: list[str], n_gpus: int) -> tuple[bool, str]:
    """(True, "") when titanloop's config accepts base + setting; (False, why) when it refuses the setting's values
    (a ConfigError, e.g. an AC policy or optimizer option this version has not got). A refused base raises."""
    from titanloop.config_errors import ConfigError

    load_config(gpu_check.TRAIN_CONFIG, base, world_size=n_gpus)
    try:
        load_config(gpu_check.TRAIN_CONFIG, base + setting_args, world_size=n_gpus)
    except ConfigError as e:
        return False, str(e)
    return True, ""


def _launch(cmd: list[str], log: Path, timeout: float | None, env: dict | None = None) -> tuple[int | None, str]:
    """Run `cmd` (its own process group) with output to a fresh `log`; (exit code or None on timeout, the log's
    text). gpu_check's launcher: the group is stopped at the timeout, torchrun's workers with it."""
    log.unlink(missing_ok=True)
    code = gpu_check.run_logged(cmd, log, timeout, env=env, cwd=ROOT)
    return code, log.read_text(errors="replace")


def _row(job: Job, trainer: str, status: str, reason: str = "", **kw) -> Row:
    s = job.setting
    label = s.label if job.role in ("matrix", "t8") else _compare_label(job)
    return Row(label, trainer, s.n_loops, s.micro_batch, s.ac, s.precision, status, reason, **kw)


def _compare_label(job: Job) -> str:
    layers = job.model_overrides.get("n_layers")
    again = f", launch {job.launch}" if job.launch > 1 else ""
    if job.role == "dense":
        return f"torchtitan dense llama3, {layers} layers, {job.setting.micro_batch} seq, no AC, bf16{again}"
    kind = "looped" if job.role == "looped" else "dense"
    s = job.setting
    return f"titanloop {kind}, {layers} layers x T={s.n_loops}, {s.micro_batch} seq, no AC, bf16{again}"


def _timeout(ctx: Context, estimate: float, remaining: float | None) -> float:
    limit = max(180.0, 4 * estimate) if not ctx.smoke else 900.0
    return limit if remaining is None else max(30.0, min(limit, remaining))


def step_seconds(ctx: Context, s: Setting, tokens_per_s_gpu: float) -> float:
    """Seconds per optimizer step (world 1) from the measured tokens/s: every accumulated micro-batch counts."""
    return s.sequences_per_step * ctx.seq_len / tokens_per_s_gpu


def run_titanloop(ctx: Context, job: Job, remaining: float | None) -> Row:
    s = job.setting
    ctx.launches += 1
    run_dir = ctx.workdir / f"{ctx.launches:02d}-{job.role}-T{s.n_loops}-mb{s.micro_batch}-{s.ac}-{s.precision}"
    base, setting_args = titanloop_args(ctx, job, run_dir)
    try:
        accepted, why = check_accepted(base, setting_args, ctx.n_gpus)
    except Exception as e:  # noqa: BLE001 - a broken base is this row's failure, the others still run
        return _row(job, "titanloop", "failed", f"config: {e}"[:240])
    if not accepted:
        return _row(job, "titanloop", "unsupported", f"not accepted by this trainer: {why}"[:240])
    missing = gpu_check.missing_modules("bf16" if s.precision == "off" else s.precision)
    if missing:
        return _row(job, "titanloop", "failed", f"{ctx.python} cannot import {missing}")
    prefix = [str(SCRIPT), "--inject-oom", "2"] if s.inject_oom else None
    cmd = gpu_check.torchrun_command(ctx.python, ctx.n_gpus, base + setting_args, prefix)
    log = run_dir.with_suffix(".log")
    start = time.perf_counter()
    code, out = _launch(cmd, log, _timeout(ctx, job.estimate_s, remaining))
    wall = time.perf_counter() - start
    _keep_log(ctx, log)
    common = {"wall_s": wall, "estimate_s": job.estimate_s, "run_dir": str(run_dir)}
    if code is None:
        return _row(job, "titanloop", "timeout", f"killed after {wall:.0f} s", **common)
    if code != 0:
        status = "oom" if is_oom(code, out) else "failed"
        return _row(job, "titanloop", status, failure_reason(out, code), **common)
    exclude = set(range(ctx.steps + 1, ctx.steps + 1 + PROFILE_STEPS)) if job.profile else set()
    try:
        m = median_throughput(gpu_check._metrics(run_dir), ctx.warmup, exclude, ctx.n_gpus)
    except ValueError as e:
        return _row(job, "titanloop", "failed", str(e), **common)
    row = _row(job, "titanloop", "ok", step_s=step_seconds(ctx, s, m["tokens_per_s_gpu"]), **m, **common)
    if job.profile:
        row.extra["profile"] = profile_summary(ctx, run_dir)
    return row


def run_torchtitan(ctx: Context, job: Job, spec: DenseSpec, remaining: float | None) -> Row:
    """The dense baseline: torchrun benchmarks/torchtitan_dense.py (torchtitan.train.main with the harness)."""
    missing = gpu_check.missing_modules()
    if missing:
        return _row(job, "torchtitan", "failed", f"{ctx.python} cannot import {missing}")
    Path(spec.dump_folder).mkdir(parents=True, exist_ok=True)
    cmd = [ctx.python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ctx.n_gpus}"]
    cmd += [str(ROOT / "benchmarks" / "torchtitan_dense.py")]
    env = {**os.environ, SPEC_ENV: spec.to_env(), "PYTHONPATH": _pythonpath()}
    log = Path(spec.dump_folder).with_suffix(".log")
    start = time.perf_counter()
    code, out = _launch(cmd, log, _timeout(ctx, job.estimate_s, remaining), env)
    wall = time.perf_counter() - start
    _keep_log(ctx, log)
    common = {"wall_s": wall, "estimate_s": job.estimate_s, "run_dir": spec.dump_folder}
    if code is None:
        return _row(job, "torchtitan", "timeout", f"killed after {wall:.0f} s", **common)
    if code != 0:
        status = "oom" if is_oom(code, out) else "failed"
        return _row(job, "torchtitan", status, failure_reason(out, code), **common)
    path = Path(spec.metrics_jsonl)
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    try:
        m = dense_throughput(rows, ctx.warmup)
    except ValueError as e:
        return _row(job, "torchtitan", "failed", str(e), **common)
    extra = {k: m.pop(k) for k in ("torchtitan_flops_per_token", "torchtitan_peak_flops")}
    if not ctx.cuda:  # torchtitan quotes an A100's peak for the CPU
        m["mfu"] = None
    step_s = spec.local_batch_size * spec.seq_len / m["tokens_per_s_gpu"]
    return _row(job, "torchtitan", "ok", step_s=step_s, extra=extra, **m, **common)


def _pythonpath() -> str:
    return os.pathsep.join([str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])


def _keep_log(ctx: Context, log: Path) -> None:
    """Every run's log goes to --artifacts (the only way to read a failure after a one-call GPU run)."""
    ctx.artifacts.mkdir(parents=True, exist_ok=True)
    shutil.copy(log, ctx.artifacts / log.name)


def profile_summary(ctx: Context, run_dir: Path) -> dict:
    """Summarize the profiled steps' trace (rank 0) and keep it gzipped in --artifacts."""
    traces = sorted(run_dir.glob("profiles/step_*/rank0_trace.json"))
    if not traces:
        return {"error": f"no trace under {run_dir}/profiles"}
    trace = traces[-1]
    try:
        summary = summarize_trace(json.loads(trace.read_text()))
    except (ValueError, json.JSONDecodeError) as e:
        summary = {"error": f"{trace.name}: {e}"}
    ctx.artifacts.mkdir(parents=True, exist_ok=True)
    kept = ctx.artifacts / f"gpu_throughput_trace_{run_dir.name}.json.gz"  # one per profiled run
    with open(trace, "rb") as src, gzip.open(kept, "wb", compresslevel=6) as dst:
        shutil.copyfileobj(src, dst)
    return {**summary, "trace": kept.name, "trace_mib": kept.stat().st_size / 2**20, "steps": trace.parent.name}


def attach_float8_comparisons(pairs: list[tuple[Job, Row]], ctx: Context) -> None:
    """Each profiled float8 matrix row whose bf16 twin was profiled too gets float8_vs_bf16 of the two traces (kept
    in ctx.artifacts) as extra["float8_vs_bf16"] (or the error that kept it from being computed)."""
    profiled = {j.setting: r for j, r in pairs if j.role == "matrix" and r.ok and "trace" in r.extra.get("profile", {})}
    for setting, row in profiled.items():
        base = profiled.get(bf16_twin(setting))
        if setting.precision == "off" or base is None:
            continue
        try:
            traces = [read_trace(ctx.artifacts / r.extra["profile"]["trace"]) for r in (base, row)]
            comparison = float8_vs_bf16(*traces)
        except (OSError, ValueError, KeyError) as e:
            comparison = {"error": f"{type(e).__name__}: {e}"[:240]}
        row.extra["float8_vs_bf16"] = {"bf16_row": base.label, **comparison}


# ----- the plan -------------------------------------------------------------------------------------------------------
def comparison_jobs(ctx: Context, dense_layers: int, titanloop_dense: bool, launch: int = 1) -> list[Job]:
    dense_setting = Setting(COMPARE_MB, COMPARE_AC, n_loops=1)
    jobs = [
        Job("looped", Setting(COMPARE_MB, COMPARE_AC), {"n_layers": looped_layers(ctx)}, launch=launch),
        Job("dense", dense_setting, {"n_layers": dense_layers}, launch=launch),
    ]
    if titanloop_dense and launch == 1:
        jobs.append(Job("titanloop_dense", dense_setting, {"n_layers": dense_layers}))
    return jobs


def looped_layers(ctx: Context) -> int:
    return 2 if ctx.smoke else LOOPED_LAYERS  # debug-tiny has 2 layers


def bf16_twin(s: Setting) -> Setting:
    """The same row in bf16 (float8 recipe off)."""
    return dataclasses.replace(s, precision="off")


def build_plan(
    ctx: Context,
    matrix: list[Setting],
    *,
    profile: bool,
    dense: bool,
    always_titanloop_dense: bool,
    compare_launches: int = 1,
):
    """The launches in priority order: the first matrix row (profiled), the looped-vs-dense comparison, the first
    row's float8 twins (the rows right after it that are), the comparison's further launches (compare_launches in
    all: a second pair tells launch-to-launch spread from a difference), the rest of the matrix; the T = 8 row is
    added at run time. The float8 twins are profiled too, so that float8's time can be set against bf16's kernel by
    kernel (float8_vs_bf16). Each job carries its H100 estimate."""
    if not matrix:
        return []

    def float8_twin(s: Setting) -> bool:
        return s.precision != "off" and bf16_twin(s) == matrix[0]

    rest = [Job("matrix", s, profile=profile and float8_twin(s)) for s in matrix[1:]]
    twins = next((i for i, s in enumerate(matrix[1:]) if not float8_twin(s)), len(rest))
    jobs = [Job("matrix", matrix[0], profile=profile)]
    if dense:
        layers = comparison_layers(ctx)
        jobs += comparison_jobs(ctx, layers, always_titanloop_dense) + rest[:twins]
        for launch in range(2, compare_launches + 1):
            jobs += comparison_jobs(ctx, layers, always_titanloop_dense, launch)
        jobs += rest[twins:]
    else:
        jobs += rest
    for j in jobs:
        j.estimate_s = job_estimate_s(ctx, j)
    return jobs


def comparison_layers(ctx: Context) -> int:
    looped = ctx.shape({"n_layers": looped_layers(ctx)})
    return dense_layers_for(looped, ctx.seq_len, 4, synthetic_doc_lengths(ctx.seq_len, ctx.vocab))


def dense_spec(ctx: Context, job: Job) -> DenseSpec:
    cfg = ctx.shape(job.model_overrides, 1)
    folder = ctx.workdir / ("torchtitan-dense" if job.launch == 1 else f"torchtitan-dense-{job.launch}")
    return DenseSpec(
        dump_folder=str(folder),
        metrics_jsonl=str(folder / "metrics.jsonl"),
        n_layers=cfg.n_layers,
        dim=cfg.hidden_size,
        n_heads=cfg.n_heads,
        ffn_hidden_size=cfg.ffn_hidden_size,
        vocab_size=cfg.vocab_size,
        rope_theta=cfg.rope_theta,
        seq_len=ctx.seq_len,
        local_batch_size=job.setting.micro_batch,
        steps=ctx.steps,
        lr=1e-3,  # gpu_check's training runs
        warmup_steps=2,
        compile=ctx.compile,
        activation_checkpoint="none",
        attn_backend=ctx.dense_attention,
        cuda_graphs=ctx.dense_cuda_graphs,
        motif_vocab=gpu_check.MOTIF_VOCAB,  # the same stream as the titanloop runs (train_args)
    )


def calibration(done: list[tuple[Job, Row]]) -> float:
    """How much slower than estimated the launched runs so far were (>= 1): the remaining estimates are scaled by
    it, so that a machine slower than the time model skips rows rather than overrunning the call."""
    ran = [(j.estimate_s, r.wall_s) for j, r in done if r.wall_s > 0 and j.estimate_s > 0]
    return max(1.0, sum(w for _, w in ran) / sum(e for e, _ in ran)) if ran else 1.0


def run_plan(ctx: Context, jobs: list[Job], t8: bool, log=print) -> list[tuple[Job, Row]]:
    """Run the jobs in order within ctx.budget_s (a job whose calibrated estimate no longer fits is a 'budget' row),
    then T = 8 for the fastest T = 4 matrix row whose AC holds as many loops at T = 8 (t8_candidate); a failed
    torchtitan run brings in titanloop's dense T = 1 fallback."""
    done: list[tuple[Job, Row]] = []
    start, budget = time.perf_counter(), gpu_check.Budget(ctx.budget_s)
    queue, t8_pending = list(jobs), t8
    while queue or t8_pending:
        if not queue:
            t8_pending = False
            best = best_row([(j, r) for j, r in done if t8_candidate(j)])
            if best is None:
                break
            queue.append(Job("t8", dataclasses.replace(best[0].setting, n_loops=8)))
            queue[-1].estimate_s = job_estimate_s(ctx, queue[-1])
        job = queue.pop(0)
        remaining = budget.left()
        projected = job.estimate_s * calibration(done)
        index = f"[{len(done) + 1}/{len(done) + 1 + len(queue) + int(t8_pending)}]"
        if remaining is not None and projected > remaining:
            why = f"estimated {projected:.0f} s, {remaining:.0f} s of the budget left"
            row = _row(job, _trainer(job), "budget", why, estimate_s=job.estimate_s)
        elif job.role == "dense":
            row = run_torchtitan(ctx, job, dense_spec(ctx, job), remaining)
            if not row.ok and not any(j.role == "titanloop_dense" for j in [*queue, *(d for d, _ in done)]):
                queue.insert(0, Job("titanloop_dense", job.setting, dict(job.model_overrides)))
                queue[0].estimate_s = job_estimate_s(ctx, queue[0])
        else:
            row = run_titanloop(ctx, job, remaining)
        done.append((job, row))
        log(progress_line(index, row, time.perf_counter() - start, ctx.budget_s))
    return done


def _trainer(job: Job) -> str:
    return "torchtitan" if job.role == "dense" else "titanloop"


def best_row(pairs: list[tuple[Job, Row]]):
    ok = [(j, r) for j, r in pairs if r.ok]
    return max(ok, key=lambda jr: jr[1].tokens_per_s_gpu) if ok else None


def loops_held(s: Setting, n_loops: int) -> int:
    """How many loops' saved activations the AC policy holds at the peak of backward: per-loop AC holds the loops it
    keeps plus the one it recomputes (activation_checkpoint._checkpointed_after), per-layer AC one layer's (plus
    each layer call's input, small), selective and none every loop's."""
    if s.ac == "layer":
        return 1
    held = live_loops(s.ac, n_loops, int(dict(s.extra).get(KEPT_LOOPS, 0)))
    return n_loops if held is None else held


def t8_candidate(job: Job) -> bool:
    """A T = 4 matrix row whose T = 8 twin holds no more loops' activations, so that its measured peak stands for T = 8
    (the memory plan, 1.4B, 2 x 4K, compiled: per-loop AC 34.8 GiB at T = 4, 35.4 at T = 8; 2 of 4 loops kept 60.5,
    61.1; no AC 72.6 and 124.9)."""
    s = job.setting
    return job.role == "matrix" and s.n_loops == 4 and loops_held(s, 8) == loops_held(s, 4)


def progress_line(index: str, row: Row, elapsed: float, budget: float | None) -> str:
    if row.ok:
        mfu = "n/a" if row.mfu is None else f"{100 * row.mfu:.1f}%"
        peak = "n/a" if row.peak_gib is None else f"{row.peak_gib:.1f} GiB"
        what = f"{row.tokens_per_s_gpu:,.0f} tokens/s/GPU, MFU {mfu}, peak {peak}"
    else:
        what = f"{row.status.upper()}: {row.reason}"
    left = "" if budget is None else f", {budget - elapsed:.0f} s of the budget left"
    return f"{index} {row.label}: {what} ({row.wall_s:.0f} s; {elapsed:.0f} s elapsed{left})"


# ----- the result json ------------------------------------------------------------------------------------------------
def _fmt(x, spec: str) -> str:
    return "" if x is None else format(x, spec)


def _find(pairs, role: str, setting: Setting | None = None) -> Row | None:
    for j, r in pairs:
        if j.role == role and (setting is None or j.setting == setting):
            return r
    return None


def _not_measured(row: Row | None) -> str:
    return "not run" if row is None else f"not measured ({row.status}: {row.reason})"[:200]


def summary_rows(pairs: list[tuple[Job, Row]], ctx: Context) -> list[dict]:
    """The summary with the issue's targets; `met` follows `measured` vs `target` (None when not measured)."""
    rows = []

    def add(name, measured, target=None):
        met = None
        if target is not None and isinstance(measured, (int, float)):
            met = measured >= float(target.split()[-1])
        rows.append({"row": name, "measured": measured, "target": target, "met": met})

    shipped = _find(pairs, "matrix", SHIPPED)
    name = f"MFU, bf16, T=4, shipped setting ({SHIPPED.micro_batch} x {ctx.seq_len} tokens, AC {SHIPPED.ac})"
    if shipped is None or not shipped.ok:
        add(name, _not_measured(shipped), ">= 0.40")
    else:
        add(name, "n/a (no GPU)" if shipped.mfu is None else round(shipped.mfu, 4), ">= 0.40")
    for recipe in ("tensorwise", "rowwise"):
        f8 = _find(pairs, "matrix", dataclasses.replace(SHIPPED, precision=recipe))
        if f8 is None:
            continue
        name = f"float8 {recipe} / bf16 tokens/s, T=4, shipped setting"
        if f8.ok and shipped is not None and shipped.ok:
            add(name, round(f8.tokens_per_s_gpu / shipped.tokens_per_s_gpu, 3), ">= 1.15")
        else:
            add(name, _not_measured(f8 if not f8.ok else shipped), ">= 1.15")
        cmp = f8.extra.get("float8_vs_bf16")
        if cmp is not None:
            add(f"float8 {recipe} against bf16, from the traces", cmp.get("explanation") or cmp.get("error"))
    best = best_row([(j, r) for j, r in pairs if j.role == "matrix" and j.setting.n_loops == 4])
    if best is not None:
        add(f"best tokens/s/GPU at T=4 ({best[1].label})", round(best[1].tokens_per_s_gpu))
    t8 = _find(pairs, "t8")
    if t8 is not None:
        add(f"tokens/s/GPU at T=8 ({t8.label})", round(t8.tokens_per_s_gpu) if t8.ok else _not_measured(t8))
    looped, dense = _find(pairs, "looped"), _find(pairs, "dense")
    if looped is not None:
        name = f"titanloop looped / torchtitan dense tokens/s ({_ratio_label(pairs)})"
        ratios = launch_ratios(pairs)
        if ratios:
            measured = [f"{r:.3f}" if r is not None else "not measured" for r in ratios.values()]
            if len(ratios) > 1:
                name += f"; median of the {len(ratios)} launch pairs' ratios: {', '.join(measured)}"
            add(name, round(statistics.median(r for r in ratios.values() if r is not None), 3), ">= 1.0")
        else:
            add(name, _not_measured(looped if not looped.ok else dense), ">= 1.0")
        tdense = _find(pairs, "titanloop_dense")
        if tdense is not None and looped.ok and tdense.ok:
            add(
                "titanloop looped / titanloop dense (T=1) tokens/s, equal FLOPs/token",
                round(looped.tokens_per_s_gpu / tdense.tokens_per_s_gpu, 3),
            )
    return rows


def launch_ratios(pairs) -> dict[int, float | None]:
    """{launch: looped / torchtitan-dense tokens/s of that launch's pair, or None where either run failed}, for the
    launches whose two runs were launched (not skipped for the budget); {} unless the first pair has a ratio."""
    rows = {(j.role, j.launch): r for j, r in pairs if j.role in ("looped", "dense")}
    out = {}
    for launch in sorted({k for _, k in rows}):
        looped, dense = rows.get(("looped", launch)), rows.get(("dense", launch))
        if looped is None or dense is None or looped.status == "budget" or dense.status == "budget":
            continue
        out[launch] = round(looped.tokens_per_s_gpu / dense.tokens_per_s_gpu, 3) if looped.ok and dense.ok else None
    return out if out.get(1) is not None else {}


def _ratio_label(pairs) -> str:
    looped = next((j for j, _ in pairs if j.role == "looped"), None)
    dense = next((j for j, _ in pairs if j.role == "dense"), None)
    if looped is None or dense is None:
        return "equal FLOPs/token"
    return (
        f"{looped.model_overrides['n_layers']} layers x T=4 vs {dense.model_overrides['n_layers']} layers, "
        "equal FLOPs/token"
    )


def matrix_table(pairs, ctx: Context) -> dict:
    columns = [
        "T",
        "sequences",
        "AC",
        "precision",
        "extra",
        "tokens/s/GPU",
        "MFU %",
        "TFLOP/s",
        "peak GiB",
        "step s",
        "status",
        "note",
    ]
    rows = []
    for j, r in pairs:
        if j.role not in ("matrix", "t8"):
            continue
        s = j.setting
        rows.append(
            [
                s.n_loops,
                s.micro_batch,
                s.ac,
                "bf16" if s.precision == "off" else f"float8 {s.precision}",
                " ".join([f"{k}={v}" for k, v in s.extra] + (["injected OOM"] if s.inject_oom else [])),
                _fmt(r.tokens_per_s_gpu, ",.0f"),
                _fmt(r.mfu and 100 * r.mfu, ".1f"),
                _fmt(r.tflops, ".1f"),
                _fmt(r.peak_gib, ".1f"),
                _fmt(r.step_s, ".3f"),
                r.status,
                (r.reason or ("profiled" if j.profile else ""))[:160],
            ]
        )
    title = (
        f"Training matrix ({ctx.preset}, vocab {ctx.vocab}, {ctx.seq_len} tokens/sequence, FSDP2 world {ctx.n_gpus}, "
        f"compile {'on' if ctx.compile else 'off'}, document masking; {ctx.steps} steps, median over steps "
        f"{ctx.warmup + 1}-{ctx.steps})"
    )
    return {"title": title, "columns": columns, "rows": rows}


def comparison_table(pairs, ctx: Context, flops: dict) -> dict | None:
    """Each comparison run with FLOPs per token by both counts, achieved TFLOP/s and MFU by titanloop's count (the
    same count for both models), and the trainer's own MFU (torchtitan's counts full-square attention)."""
    rows = []
    for j, r in pairs:
        if j.role not in ("looped", "dense", "titanloop_dense"):
            continue
        f = flops.get(j.role)
        tt = r.extra.get("torchtitan_flops_per_token")
        achieved = r.tokens_per_s_gpu * f if r.tokens_per_s_gpu and f else None
        rows.append(
            [
                r.label,
                _fmt(f and f / 1e9, ".4g"),
                _fmt(tt and tt / 1e9, ".4g"),
                _fmt(r.tokens_per_s_gpu, ",.0f"),
                _fmt(achieved and achieved / 1e12, ".1f"),
                _fmt(achieved and ctx.peak_flops and 100 * achieved / ctx.peak_flops, ".1f"),
                _fmt(r.mfu and 100 * r.mfu, ".1f"),
                _fmt(r.peak_gib, ".1f"),
                r.status,
                r.reason[:160],
            ]
        )
    if not rows:
        return None
    columns = [
        "run",
        "GFLOP/token (titanloop count)",
        "GFLOP/token (torchtitan count)",
        "tokens/s/GPU",
        "TFLOP/s (titanloop count)",
        "MFU % (titanloop count)",
        "MFU % (trainer's own)",
        "peak GiB",
        "status",
        "note",
    ]
    return {"title": "Looped vs dense at equal FLOPs per token", "columns": columns, "rows": rows}


def profile_tables(pairs) -> list[dict]:
    """The first profiled bf16 row's shares and top kernels, then each float8 row's comparison with its bf16 twin."""
    tables = []
    for _, r in pairs:
        if "float8_vs_bf16" in r.extra:
            tables += float8_tables(r.label, r.extra["float8_vs_bf16"])
    bf16 = [(r.label, r.extra["profile"]) for _, r in pairs if "profile" in r.extra and r.precision == "off"]
    first = bf16[0] if bf16 else None
    if first is None or "error" in first[1]:
        return tables
    label, prof = first
    shares = {
        "title": f"Profile of {label} ({PROFILE_STEPS} steps, {prof['source']} timeline {prof['span_ms']:.0f} ms)",
        "columns": ["category", "share of timeline %"],
        "rows": [[k, round(100 * v, 1)] for k, v in prof["shares"].items()],
    }
    top = {
        "title": "Top kernels by total time (the profiled steps)",
        "columns": ["kernel", "category", "calls", "total ms", "share of kernel time %"],
        "rows": [
            [
                k["name"][:90],
                k["category"],
                k["calls"],
                round(k["total_ms"], 2),
                round(100 * k["share_of_kernel_time"], 1),
            ]
            for k in prof["top"]
        ],
    }
    return [shares, top, *tables]


def float8_tables(label: str, cmp: dict) -> list[dict]:
    """A float8 row's float8_vs_bf16 as two tables: ms per step by category, and the kernels that grew most."""
    if "error" in cmp:
        return []
    by_category = {
        "title": f"{label} against {cmp['bf16_row']}, from their traces (ms per step, {cmp['steps']} profiled steps)",
        "columns": ["", "bf16 ms", "float8 ms", "float8 - bf16 ms"],
        "rows": [[c, round(b, 2), round(f, 2), round(d, 2)] for c, b, f, d in cmp["ms_per_step"]]
        + [
            ["  of float8: GEMM kernels bf16 has not got", "", round(cmp["float8_only_ms"]["gemm"], 2), ""],
            ["  of float8: other kernels bf16 has not got", "", round(cmp["float8_only_ms"]["other"], 2), ""],
        ],
    }
    growth = {
        "title": f"Kernels whose time grew most from bf16 to {label} (ms per step)",
        "columns": ["kernel", "category", "bf16 ms", "float8 ms", "float8 - bf16 ms", "float8 calls/step"],
        "rows": [
            [
                g["kernel"][:90],
                g["category"],
                round(g["bf16_ms"], 2),
                round(g["float8_ms"], 2),
                round(g["delta_ms"], 2),
                g["float8_calls_per_step"],
            ]
            for g in cmp["growth"]
        ],
    }
    return [by_category, growth]


def comparison_flops(ctx: Context, pairs) -> dict:
    """titanloop's FLOPs per token (over the synthetic documents) of each comparison run."""
    lengths = synthetic_doc_lengths(ctx.seq_len, ctx.vocab)
    out = {}
    for j, _ in pairs:
        if j.role in ("looped", "dense", "titanloop_dense"):
            cfg = ctx.shape(j.model_overrides, j.setting.n_loops)
            out[j.role] = cfg.flops_per_token(ctx.seq_len, n_loops=j.setting.n_loops, doc_lengths=lengths)
    out["attended_keys_per_token"] = attended_keys_per_token(ctx.seq_len, lengths)
    return out


def result_json(pairs, ctx: Context, meta: dict) -> dict:
    flops = comparison_flops(ctx, pairs)
    tables = [matrix_table(pairs, ctx)]
    comp = comparison_table(pairs, ctx, flops)
    if comp:
        tables.append(comp)
    tables += profile_tables(pairs)
    notes = [
        "Written by `benchmarks/gpu_throughput.py` (its docstring says what each part measures). Every titanloop row "
        "is `torchrun -m titanloop.train --config train_configs/debug.toml` with scripts/gpu_check.py's training "
        "overrides (synthetic_text, AdamW, FSDP2, compile) plus the row's; tokens/s/GPU is the median over the logged "
        "steps after the warm-up, MFU the trainer's own (every loop counted, bf16 dense peak, float8 rows included), "
        "peak GiB torch.cuda.max_memory_allocated.",
        "Looped vs dense: the dense baseline is torchtitan 0.3.0's own trainer and llama3 model (torchrun "
        "benchmarks/torchtitan_dense.py, torchtitan.train.main) with the harness's in-memory synthetic_text loader "
        "(the same documents as titanloop's runs, document-masked attention from per-document positions), a tokenizer "
        "stub and a JSONL metrics logger. Its layer count makes its FLOPs per token (titanloop's count) closest to the "
        "looped model's. Differences that remain: torchtitan uses its FlexAttention (document mask; titanloop: torch's "
        "varlen flash kernel), a plain (not chunked) cross-entropy, fused AdamW (titanloop's default: foreach), no "
        "sandwich norms, no per-loop readouts; torchtitan's own MFU counts full-square attention.",
        "torchtitan 0.3.0 on torch 2.11 (the GPU machine's): it imports torch.distributed.fsdp.DataParallelMeshDims "
        "and calls torch.distributed.set_timeout, which torch 2.11 lacks (the harness adds a placeholder and the 2.11 "
        "equivalent), and its ChunkedLossWrapper (the llama3 configs' loss) fails in backward there (the FSDP unit "
        "[norm, lm_head] frees the norm's unsharded weight), so the harness uses torchtitan's plain CrossEntropyLoss. "
        "If the torchtitan run fails anyway, titanloop's own trainer at T=1 with the dense layer count is the baseline "
        "(row 'titanloop dense').",
    ]
    if ctx.smoke:
        notes.insert(
            0,
            "SMOKE RUN on CPU at tiny shapes (debug-tiny, gloo, no compile): the numbers are meaningless; it "
            "checks that every part of the pipeline runs.",
        )
    return {
        "title": "GPU throughput: Ouro-1.4B matrix, profile, looped vs dense",
        "order": 6,
        "command": meta["command"],
        "date": meta.get("date") or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "commit": meta["commit"],
        "machine": meta["machine"],
        "summary": summary_rows(pairs, ctx),
        "tables": tables,
        "notes": notes,
        "result": {
            "context": {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(ctx).items()},
            "flops_per_token": flops,
            "runs": [{"job": job_record(j), **dataclasses.asdict(r)} for j, r in pairs],
            "torch": meta.get("torch"),
            "wall_s": meta.get("wall_s"),
        },
    }


# ----- command line ---------------------------------------------------------------------------------------------------
def parse_setting(text: str) -> Setting:
    """MB:AC:PRECISION[:T], e.g. 2:loop:off or 4:selective:tensorwise:8."""
    parts = text.split(":")
    if len(parts) not in (3, 4):
        raise ValueError(f"{text!r}: expected MB:AC:PRECISION[:T], e.g. 2:loop:off or 4:loop:tensorwise:8")
    try:
        mb, t = int(parts[0]), int(parts[3]) if len(parts) == 4 else 4
    except ValueError:
        raise ValueError(f"{text!r}: micro-batch and T must be integers, e.g. 2:loop:off:8") from None
    if mb < 1 or t < 1:
        raise ValueError(f"{text!r}: micro-batch and T must be >= 1")
    if parts[2] not in PRECISIONS:
        raise ValueError(f"{text!r}: precision {parts[2]!r} is not one of {', '.join(PRECISIONS)}")
    if not parts[1]:
        raise ValueError(f"{text!r}: empty AC policy (e.g. none, layer, loop)")
    return Setting(mb, parts[1], parts[2], t)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = _Parser(
        prog="python benchmarks/gpu_throughput.py",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    what = p.add_mutually_exclusive_group()
    what.add_argument(
        "--full",
        action="store_true",
        help="every micro-batch (1,2,4) x AC policy x precision, both optimizer implementations (~40 min)",
    )
    what.add_argument(
        "--setting",
        action="append",
        metavar="MB:AC:PREC[:T]",
        help="run these rows instead of the default matrix (repeatable)",
    )
    p.add_argument("--smoke", action="store_true", help="CPU: the whole pipeline at tiny sizes (numbers meaningless)")
    p.add_argument("--plan", action="store_true", help="print the plan and its H100 time estimate, run nothing")
    p.add_argument("--steps", type=int, help=f"steps per run (default {STEPS}; --smoke {SMOKE_STEPS})")
    p.add_argument("--warmup", type=int, help=f"first steps not measured (default {WARMUP}; --smoke {SMOKE_WARMUP})")
    p.add_argument(
        "--budget-s",
        type=float,
        help=f"seconds this script may take; rows that would not fit are skipped (default {BUDGET_S:.0f}; "
        "none with --full and --smoke)",
    )
    p.add_argument("--no-profile", action="store_true", help="do not profile the first row (nor its float8 twins)")
    p.add_argument(
        "--compare-traces",
        nargs=2,
        type=Path,
        metavar=("BF16_TRACE", "FLOAT8_TRACE"),
        help="run nothing: print where float8's step time goes against bf16's from two kept traces "
        f"(gpu_throughput_trace_*.json.gz, {PROFILE_STEPS} profiled steps each)",
    )
    p.add_argument("--no-dense", action="store_true", help="no looped-vs-dense comparison")
    p.add_argument(
        "--compare-launches",
        type=int,
        default=None,
        help=f"launches of the looped-vs-dense pair, each pair's ratio reported and their median judged (default "
        f"{COMPARE_LAUNCHES}; --smoke: 1); the second pair runs after the float8 twins",
    )
    p.add_argument(
        "--dense-attention",
        choices=("flex", "varlen", "sdpa"),
        help="torchtitan's attention (default flex; --smoke: sdpa)",
    )
    p.add_argument(
        "--dense-cuda-graphs",
        action="store_true",
        help="torchtitan's fwd+bwd CUDA graph (its default; off here as titanloop has none)",
    )
    p.add_argument("--out", type=Path, default=RESULT_JSON, help="result json (default %(default)s)")
    p.add_argument(
        "--artifacts",
        type=Path,
        default=DEFAULT_ARTIFACTS,
        help="where the gzipped trace, run logs and a copy of the json go (default %(default)s)",
    )
    p.add_argument("--no-json", action="store_true", help="print only")
    p.add_argument(
        "--commit",
        help="the commit measured, for the json (default: this checkout's HEAD; a copy without .git, such as the GPU "
        "machine's, should pass the hash it was made from)",
    )
    p.add_argument("--python", default=sys.executable, help="interpreter of the training runs (default: this one)")
    a = p.parse_args(argv)
    try:
        a.settings = [parse_setting(t) for t in a.setting] if a.setting else None
    except ValueError as e:
        p.error(f"--setting {e}")
    for flag in ("steps", "warmup"):
        v = getattr(a, flag)
        if v is not None and v < (1 if flag == "steps" else 0):
            p.error(f"--{flag} {v}: expected an integer >= {1 if flag == 'steps' else 0}")
    steps = a.steps or (SMOKE_STEPS if a.smoke else STEPS)
    warmup = a.warmup if a.warmup is not None else (SMOKE_WARMUP if a.smoke else WARMUP)
    if warmup >= steps:
        p.error(f"--warmup {warmup} >= --steps {steps}: no step would be measured")
    if a.commit is not None and not re.fullmatch(r"[0-9a-f]{40}", a.commit):
        p.error(f"--commit {a.commit!r}: expected a full 40-digit commit hash (git rev-parse HEAD)")
    if a.budget_s is not None and a.budget_s <= 0:
        p.error(f"--budget-s {a.budget_s}: expected seconds > 0")
    if a.compare_launches is not None and a.compare_launches < 1:
        p.error(f"--compare-launches {a.compare_launches}: expected an integer >= 1")
    if a.compare_launches is None:
        a.compare_launches = 1 if a.smoke else COMPARE_LAUNCHES
    a.steps, a.warmup = steps, warmup
    return a


def make_context(a: argparse.Namespace, workdir: Path) -> Context:
    budget = a.budget_s if a.budget_s is not None else (None if (a.full or a.smoke) else BUDGET_S)
    kw = {"workdir": workdir, "artifacts": a.artifacts, "budget_s": budget, "python": a.python}
    kw["dense_cuda_graphs"] = a.dense_cuda_graphs
    if a.dense_attention:
        kw["dense_attention"] = a.dense_attention
    ctx = smoke_context(**kw) if a.smoke else gpu_context(**kw)
    ctx.steps, ctx.warmup = a.steps, a.warmup
    return ctx


def matrix_of(a: argparse.Namespace) -> list[Setting]:
    if a.settings:
        return a.settings
    if a.smoke:
        return SMOKE_MATRIX
    return FULL_MATRIX if a.full else DEFAULT_MATRIX


_BUDGET_ENDS = "  -- by the estimates the budget ends here: what follows runs only if the rows above are faster --"


def print_plan(ctx: Context, jobs: list[Job], t8: bool) -> None:
    spent, past = 0.0, False
    for i, j in enumerate(jobs, 1):
        spent += j.estimate_s
        if ctx.budget_s is not None and spent > ctx.budget_s and not past:
            past = True
            print(_BUDGET_ENDS)
        what = j.setting.label if j.role == "matrix" else _compare_label(j)
        print(f"  {i:2d}. {j.role:<15} {what}{' (profiled)' if j.profile else ''}: ~{j.estimate_s:.0f} s")
    total = plan_estimate_s(ctx, jobs) if t8 else sum(j.estimate_s for j in jobs)
    budget = "no budget" if ctx.budget_s is None else f"budget {ctx.budget_s:.0f} s"
    if t8:
        t8_s = total - sum(j.estimate_s for j in jobs)
        if ctx.budget_s is not None and total > ctx.budget_s and not past:
            print(_BUDGET_ENDS)
        print(f"  +   t8              T=8 of the fastest T=4 row with per-loop or per-layer AC: ~{t8_s:.0f} s at most")
    print(f"estimated {total:.0f} s on one H100 ({budget}; a call of {CALL_S} s includes ~{INSTALL_S} s for wheels)")


def inject_oom_main(at_step: int, train_argv: list[str]) -> int:
    """`torchrun ... gpu_throughput.py --inject-oom STEP --config ... [overrides]`: titanloop's trainer whose step
    STEP raises torch.OutOfMemoryError as a real one would (the smoke run's OOM row)."""
    import torch

    from titanloop.train import loop
    from titanloop.train.__main__ import main as train_main

    real_step = loop.train_step

    def train_step(run, batches, callbacks):
        if run.state.step == at_step:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate 20.00 GiB (injected at step {at_step} by gpu_throughput.py)"
            )
        return real_step(run, batches, callbacks)

    loop.train_step = train_step
    return train_main(train_argv)


def compare_traces_main(bf16: Path, float8: Path) -> int:
    """--compare-traces: float8_vs_bf16 of two kept traces, printed."""
    try:
        cmp = float8_vs_bf16(read_trace(bf16), read_trace(float8))
    except (OSError, ValueError, EOFError) as e:
        print(f"gpu_throughput: --compare-traces: cannot read the traces: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    for table in float8_tables(float8.name, {"bf16_row": bf16.name, **cmp}):
        print(table["title"])
        print("  " + " | ".join(table["columns"]))
        for row in table["rows"]:
            print("  " + " | ".join(str(x) for x in row))
    print(cmp["explanation"])
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--inject-oom"]:
        return inject_oom_main(int(argv[1]), argv[2:])
    a = parse_args(argv)
    if a.compare_traces:
        return compare_traces_main(*a.compare_traces)
    gpu_check.exit_on_sigterm()  # a part stopped by gpu_session stops its run on the way out
    import torch

    matrix = matrix_of(a)
    with tempfile.TemporaryDirectory(prefix="gpu_throughput_") as tmp:
        ctx = make_context(a, Path(tmp))
        if not a.plan and not a.smoke:
            message = no_cuda_message()
            if message:
                print(message)
                return 1
        jobs = build_plan(
            ctx,
            matrix,
            profile=not a.no_profile,
            dense=not a.no_dense,
            always_titanloop_dense=a.full or a.smoke,
            compare_launches=a.compare_launches,
        )
        t8 = not a.settings
        print(f"gpu_throughput: {len(jobs)} runs{' + T=8 of the fastest' if t8 else ''}:", flush=True)
        print_plan(ctx, jobs, t8)
        if a.plan:
            return 0
        if torch.cuda.is_available():
            ctx.n_gpus = 1
            device = torch.cuda.get_device_name(0)
            ctx.cuda, ctx.peak_flops = True, gpu_check.peak_flops(device)
            machine = f"1 x {device}, torch {torch.__version__}"
        else:
            machine = f"CPU only (smoke run: tiny shapes, numbers meaningless), torch {torch.__version__}"
        start = time.perf_counter()
        pairs = run_plan(ctx, jobs, t8, log=lambda line: print(line, flush=True))
        attach_float8_comparisons(pairs, ctx)
        wall = time.perf_counter() - start
        print(f"gpu_throughput: {len(pairs)} runs in {wall:.0f} s ({machine})")
        meta = {
            "command": shlex.join(["python", "benchmarks/gpu_throughput.py", *argv]),
            "commit": a.commit or measured_commit("gpu_throughput") or "unknown",
            "machine": machine,
            "torch": torch.__version__,
            "wall_s": wall,
        }
        doc = result_json(pairs, ctx, meta)
        for r in doc["summary"]:
            target = (
                f" (target {r['target']}: {'met' if r['met'] else 'not met' if r['met'] is False else 'n/a'})"
                if r["target"]
                else ""
            )
            print(f"  {r['row']}: {r['measured']}{target}")
        if not a.no_json:
            gpu_check.write_json(a.out, doc)
            ctx.artifacts.mkdir(parents=True, exist_ok=True)
            shutil.copy(a.out, ctx.artifacts / a.out.name)
            print(f"wrote {a.out} (and a copy, the run logs and the trace in {ctx.artifacts})")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    code = main()
    if sys.argv[1:2] == ["--inject-oom"]:
        from titanloop.train.process_exit import exit_without_teardown

        exit_without_teardown(code)
    sys.exit(code)
