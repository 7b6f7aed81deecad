"""`python benchmarks/gpu_throughput.py`: training throughput of the Ouro-1.4B shape on one GPU, a matrix of
settings, each a real `torchrun -m titanloop.train` run (train_configs/debug.toml with titanloop.checks.runs'
overrides: vocab 49152, 4096 tokens/sequence, FSDP2 world 1, compile, document masking, synthetic text).

    python benchmarks/gpu_throughput.py                            # the default matrix (about 6 minutes on an H100)
    python benchmarks/gpu_throughput.py --setting 2:selective:off --setting 2:selective:tensorwise --profile
    python benchmarks/gpu_throughput.py --full                     # micro-batch x AC policy x precision (~40 min)
    python benchmarks/gpu_throughput.py --smoke --out /tmp/g.json  # the CPU at tiny sizes (numbers meaningless)
    python benchmarks/gpu_throughput.py --compare-traces BF16.json.gz FLOAT8.json.gz   # two kept traces, no run
    python benchmarks/gpu_throughput.py --vs-dense [--launches 2]   # looped vs torchtitan's dense model (see below)

A setting is MB:AC:PRECISION[:T[:ACCUM]]: sequences per micro-batch, `parallelism.activation_checkpoint` (`loop2`:
per-loop AC keeping the first 2 loops, `parallelism.ac_kept_loops`), `float8.recipe` (off = bf16), the loop count
(default 4) and micro-batches accumulated per step (default 1). Each row: tokens/s/GPU (the median over the logged
steps after the warm-up, with `--metrics.breakdown false`, so that the step timer adds no barriers), MFU (the
trainer's own, titanloop.train.mfu: every loop counted, attention over the attended keys, the device's bf16 dense
peak), TFLOP/s, peak GiB (max_mem_gib), or why there is none: out of memory, a value the trainer's config refuses,
a failure. `--profile` runs each row 2 more steps under torch.profiler (left out of its throughput), summarizes the
trace (GPU time by kernel category, idle, top kernels), keeps it gzipped in --artifacts, and sets each float8 row's
trace against its bf16 twin's kernel by kernel. The summary's targets: MFU >= 0.45 (bf16, T = 4, the shipped
setting, train_configs/ouro_1p4b.toml's sequences and AC), float8 tensorwise / bf16 tokens/s >= 1.15. Without CUDA
(and without --smoke) it prints one line and exits 1.

--vs-dense: titanloop's looped model against torchtitan's own dense trainer at equal FLOPs per token (a record of
its own, <date>-<device>-looped-vs-dense.json; about 5 minutes on an H100, 2 launches of each). The looped model: 6
shared layers x T = 4 at the Ouro-1.4B width (hidden 2048, 16 heads, FFN 5632, vocab 49152), `torchrun -m
titanloop.train`. The dense one: torchtitan 0.3.0's `torchtitan.train.main` with its llama3 model of the same width
(benchmarks/torchtitan_dense.py, the harness), with as many layers as make its FLOPs per token closest to the looped
model's, both counted by LoopLMConfig.flops_per_token over the runs' documents (the trainer's count; 30 layers).
Both: 2 x 4096 tokens per step, bf16 compute with fp32 master weights and reduction, compile, no activation
checkpointing, fused AdamW, the same synthetic documents. Each pair is launched --launches times (one launch of a
shape can run up to 20% slower than another); the summary judges the median of the pairs' ratios, target >= 1.0.
Where the torchtitan run fails, titanloop's own trainer at T = 1 with the dense layer count is the baseline.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gzip
import itertools
import json
import os
import re
import shlex
import shutil
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's titanloop and benchmarks, when run as a script

from benchmarks.torchtitan_dense import SPEC_ENV, DenseSpec  # noqa: E402
from titanloop.checks import runs  # noqa: E402
from titanloop.model.config import LoopLMConfig, attended_keys_per_token, preset  # noqa: E402
from titanloop.train.config import load_config  # noqa: E402
from titanloop.train.launch import torchrun  # noqa: E402
from titanloop.train.mfu import device_name, peak_flops  # noqa: E402

PRECISIONS = ("off", "tensorwise", "rowwise")  # --float8.recipe
_shipped = load_config(ROOT / "train_configs" / "ouro_1p4b.toml", [])
SHIPPED_MB, SHIPPED_AC = _shipped.training.micro_batch_size, _shipped.parallelism.activation_checkpoint
STEPS, WARMUP, PROFILE_STEPS = 8, 3, 2  # the first WARMUP steps (compile, allocator, autotuning) are not measured
OOM = ("OutOfMemoryError", "CUDA out of memory", "CUDA error: out of memory", "CUBLAS_STATUS_ALLOC_FAILED")


@dataclass(frozen=True)
class Setting:
    """One row of the matrix: overrides of the trainer's config."""

    micro_batch: int
    ac: str  # --parallelism.activation_checkpoint; loopK: per-loop AC keeping the first K loops
    precision: str = "off"  # --float8.recipe
    n_loops: int = 4
    accum: int = 1  # micro-batches per optimizer step

    @property
    def label(self) -> str:
        prec = "bf16" if self.precision == "off" else f"float8 {self.precision}"
        accum = f", {self.accum} micro-batches per step" if self.accum > 1 else ""
        return f"T={self.n_loops} {self.micro_batch} seq, AC {self.ac}, {prec}{accum}"

    def overrides(self) -> list[str]:
        kept = re.fullmatch(r"loop(\d+)", self.ac)
        ac = ["--parallelism.activation_checkpoint", "loop", "--parallelism.ac_kept_loops", kept[1]] if kept else [
            "--parallelism.activation_checkpoint", self.ac]  # fmt: skip
        return ac + ["--training.global_batch_size", str(self.micro_batch * self.accum)]


SHIPPED = Setting(SHIPPED_MB, SHIPPED_AC)
# The default matrix: the shipped setting (as one step of it, then accumulating two micro-batches as the configs
# do), what more memory allows (no AC; twice the sequences), the AC policies the 80 GB configs choose between, the
# float8 twins of the shipped setting, and T = 8
DEFAULT_MATRIX = [
    SHIPPED,
    dataclasses.replace(SHIPPED, accum=2),
    Setting(SHIPPED_MB, "none"),
    Setting(2 * SHIPPED_MB, SHIPPED_AC),
    Setting(SHIPPED_MB, "loop"),
    Setting(SHIPPED_MB, "loop2"),
    Setting(SHIPPED_MB, SHIPPED_AC, "tensorwise"),
    Setting(SHIPPED_MB, SHIPPED_AC, "rowwise"),
    Setting(SHIPPED_MB, "loop", n_loops=8),
]
FULL_MATRIX = [SHIPPED] + [
    s for mb, ac, p in itertools.product((1, 2, 4), ("none", "layer", "loop", "loop2", "selective"), PRECISIONS)
    if (s := Setting(mb, ac, p)) != SHIPPED
]  # fmt: skip
SMOKE_MATRIX = [SHIPPED, Setting(SHIPPED_MB, SHIPPED_AC, "tensorwise"), Setting(1, "no-such-policy")]


@dataclass
class Row:
    setting: Setting
    status: str  # ok | oom | unsupported | failed
    reason: str = ""
    tokens_per_s_gpu: float | None = None
    mfu: float | None = None
    tflops: float | None = None
    peak_gib: float | None = None
    steps_measured: int = 0
    profile: dict = field(default_factory=dict)


def is_oom(returncode: int | None, output: str) -> bool:
    """A failed run that ran out of device memory (PyTorch's OutOfMemoryError or CUDA's/cuBLAS's own message)."""
    return returncode not in (0, None) and any(p in output for p in OOM)


def parse_setting(text: str) -> Setting:
    """MB:AC:PRECISION[:T[:ACCUM]], e.g. 2:selective:off or 1:loop:tensorwise:8."""
    parts = text.split(":")
    if not 3 <= len(parts) <= 5 or not parts[1]:
        raise ValueError(f"{text!r}: expected MB:AC:PRECISION[:T[:ACCUM]], e.g. 2:selective:off or 1:loop:off:8")
    if parts[2] not in PRECISIONS:
        raise ValueError(f"{text!r}: precision {parts[2]!r} is not one of {', '.join(PRECISIONS)}")
    try:
        mb, t, accum = int(parts[0]), int((parts[3:] or [4])[0]), int((parts[4:] or [1])[0])
    except ValueError:
        raise ValueError(f"{text!r}: micro-batch, T and ACCUM must be integers, e.g. 2:loop:off:8:2") from None
    if min(mb, t, accum) < 1:
        raise ValueError(f"{text!r}: micro-batch, T and ACCUM must be >= 1")
    return Setting(mb, parts[1], parts[2], t, accum)


def run_setting(a: argparse.Namespace, s: Setting, work: Path, index: int) -> Row:
    """One row: the trainer's config checked first (a refused value is 'unsupported'), then the run."""
    from titanloop.config_errors import ConfigError

    run_dir = work / f"{index:02d}-T{s.n_loops}-mb{s.micro_batch}-{s.ac}-{s.precision}"
    steps = a.steps + (PROFILE_STEPS if a.profile else 0)
    precision = "bf16" if s.precision == "off" else s.precision
    args = runs.train_args(run_dir, a.preset, {}, s.n_loops, a.seq_len, 1, precision, steps, s.micro_batch)
    args += ["--metrics.log_freq", "1", "--metrics.breakdown", "false", "--model.vocab_size", str(a.vocab)]
    args += ["--lr_scheduler.warmup_steps", "2", "--parallelism.compile", str(not a.smoke).lower(), *s.overrides()]
    if a.profile:
        args += ["--profiling.enable", "true", "--profiling.start_step", str(a.steps + 1), "--profiling.steps"]
        args += [str(PROFILE_STEPS), "--profiling.memory_snapshot", "false"]
    try:
        load_config(runs.TRAIN_CONFIG, args, world_size=1)
    except ConfigError as e:
        return Row(s, "unsupported", f"not accepted by the trainer: {e}"[:240])
    log = run_dir.with_suffix(".log")
    code = runs.run(torchrun(1, "-m", "titanloop.train", "--config", str(runs.TRAIN_CONFIG), *args), log, None)
    a.artifacts.mkdir(parents=True, exist_ok=True)
    shutil.copy(log, a.artifacts / log.name)
    if code != 0:
        return Row(s, "oom" if is_oom(code, log.read_text(errors="replace")) else "failed", runs.failure(code, log))
    exclude = set(range(a.steps + 1, steps + 1))
    try:
        m = runs.median_throughput(runs.metrics(run_dir), a.warmup, exclude)
    except ValueError as e:
        return Row(s, "failed", str(e))
    row = Row(s, "ok", **m)
    if a.profile:
        row.profile = profile_summary(a, run_dir)
    return row


def profile_summary(a: argparse.Namespace, run_dir: Path) -> dict:
    """The profiled steps' trace (rank 0) summarized, and kept gzipped in --artifacts."""
    traces = sorted(run_dir.glob("profiles/step_*/rank0_trace.json"))
    if not traces:
        return {"error": f"no trace under {run_dir.name}/profiles"}
    try:
        summary = summarize_trace(json.loads(traces[-1].read_text()))
    except (ValueError, json.JSONDecodeError) as e:
        summary = {"error": f"{traces[-1].name}: {e}"}
    kept = a.artifacts / f"trace_{run_dir.name}.json.gz"
    with open(traces[-1], "rb") as src, gzip.open(kept, "wb", compresslevel=6) as dst:
        shutil.copyfileobj(src, dst)
    return {**summary, "trace": kept.name}


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
    """gemm | attention | elementwise | nccl | memory | other, from a kernel's (or CPU operator's) name; the first
    rule that matches wins (an attention kernel built of GEMM pieces is attention)."""
    if cat in ("gpu_memcpy", "gpu_memset"):
        return "memory"
    rules = (("memory", _MEMORY), ("nccl", _NCCL), ("attention", _ATTENTION), ("gemm", _GEMM))
    return next((c for c, rx in (*rules, ("elementwise", _ELEMENTWISE)) if rx.search(name)), "other")


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
    top = [{"name": n, "category": c, "calls": k, "total_ms": d / 1e3, "share_of_kernel_time": d / total}
           for n, (k, d, c) in ranked]  # fmt: skip
    shares = {**{c: v / span for c, v in by_cat.items()}, "idle": 1 - busy / span}
    return {"source": source, "events": len(device), "span_ms": span / 1e3, "busy_ms": busy / 1e3, "shares": shares,
            "top": top}  # fmt: skip


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
        {"kernel": n, "category": t("float8", n)[2] or t("bf16", n)[2], "bf16_ms": t("bf16", n)[1] / per,
         "float8_ms": t("float8", n)[1] / per, "delta_ms": (t("float8", n)[1] - t("bf16", n)[1]) / per,
         "float8_calls_per_step": t("float8", n)[0] / steps}
        for n in grown if t("float8", n)[1] > t("bf16", n)[1]
    ]  # fmt: skip
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
    return {"steps": steps, "source": sums["float8"]["source"],
            "ms_per_step": rows,  # [category | idle | timeline, bf16, float8, float8 - bf16]
            "float8_only_ms": {"gemm": new_gemm, "other": new_other}, "float8_only_kernels": len(only),
            "growth": growth, "explanation": explanation}  # fmt: skip


def read_trace(path: Path) -> dict:
    """A chrome trace, gzipped (as --artifacts keeps it) or not."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


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
        "rows": [[g["kernel"][:90], g["category"], *(round(g[k], 2) for k in ("bf16_ms", "float8_ms", "delta_ms")),
                  g["float8_calls_per_step"]] for g in cmp["growth"]],
    }  # fmt: skip
    return [by_category, growth]


def attach_float8_comparisons(rows: list[Row], artifacts: Path) -> None:
    """Each profiled float8 row whose bf16 twin (same sequences, AC, T) was profiled too gets float8_vs_bf16 of the
    two kept traces under profile["float8_vs_bf16"] (or the error that kept it from being computed)."""
    traced = {r.setting: r for r in rows if "trace" in r.profile}
    for s, row in traced.items():
        base = traced.get(dataclasses.replace(s, precision="off"))
        if s.precision == "off" or base is None:
            continue
        try:
            comparison = float8_vs_bf16(*(read_trace(artifacts / r.profile["trace"]) for r in (base, row)))
        except (OSError, ValueError, KeyError) as e:
            comparison = {"error": f"{type(e).__name__}: {e}"[:240]}
        row.profile["float8_vs_bf16"] = {"bf16_row": base.setting.label, **comparison}


# ----- the result json -----------------------------------------------------------------------------------------------
def summary_rows(rows: list[Row]) -> list[dict]:
    """The targets of the summary; `met` follows `measured` (None when not measured)."""
    by = {r.setting: r for r in rows}
    out = []

    def add(name, measured, target=None):
        met = measured >= float(target.split()[-1]) if target and isinstance(measured, float) else None
        out.append({"row": name, "measured": measured, "target": target, "met": met})

    def why(r: Row | None) -> str:
        return "not run" if r is None else f"not measured ({r.status}: {r.reason})"[:200]

    shipped = by.get(SHIPPED)
    name = f"MFU, bf16, T=4, shipped setting ({SHIPPED.micro_batch} x 4096 tokens, AC {SHIPPED.ac})"
    if shipped is not None and shipped.status == "ok":
        add(name, "n/a (no peak known for this device)" if shipped.mfu is None else round(shipped.mfu, 4), ">= 0.45")
    else:
        add(name, why(shipped), ">= 0.45")
    for recipe in ("tensorwise", "rowwise"):
        f8 = by.get(dataclasses.replace(SHIPPED, precision=recipe))
        if f8 is None:
            continue
        ok = f8.status == "ok" and shipped is not None and shipped.status == "ok"
        ratio = (
            round(f8.tokens_per_s_gpu / shipped.tokens_per_s_gpu, 3)
            if ok
            else why(f8 if f8.status != "ok" else shipped)
        )
        add(f"float8 {recipe} / bf16 tokens/s, T=4, shipped setting", ratio, ">= 1.15")
        cmp = f8.profile.get("float8_vs_bf16")
        if cmp is not None:
            add(f"float8 {recipe} against bf16, from the traces", cmp.get("explanation") or cmp.get("error"))
    best = max((r for r in rows if r.status == "ok" and r.setting.n_loops == 4), key=lambda r: r.tokens_per_s_gpu,
               default=None)  # fmt: skip
    if best is not None:
        add(f"best tokens/s/GPU at T=4 ({best.setting.label})", round(best.tokens_per_s_gpu))
    return out


def result_json(rows: list[Row], a: argparse.Namespace, meta: dict) -> dict:
    f = lambda x, spec: "" if x is None else format(x, spec)  # noqa: E731
    columns = ["T", "sequences", "AC", "precision", "accum", "tokens/s/GPU", "MFU %", "TFLOP/s", "peak GiB", "status"]
    table = [
        [r.setting.n_loops, r.setting.micro_batch, r.setting.ac, r.setting.precision.replace("off", "bf16"),
         r.setting.accum, f(r.tokens_per_s_gpu, ",.0f"), f(r.mfu and 100 * r.mfu, ".1f"), f(r.tflops, ".1f"),
         f(r.peak_gib, ".1f"), r.status + (f": {r.reason}"[:160] if r.reason else "")]
        for r in rows
    ]  # fmt: skip
    title = f"Training matrix ({a.preset}, vocab {a.vocab}, {a.seq_len} tokens/sequence, FSDP2 world 1, compile "
    title += (
        f"{'off' if a.smoke else 'on'}, document masking; {a.steps} steps, median over steps {a.warmup + 1}-{a.steps})"
    )
    tables = [{"title": title, "columns": columns, "rows": table}]
    for r in rows:
        if "float8_vs_bf16" in r.profile:
            tables += float8_tables(r.setting.label, r.profile["float8_vs_bf16"])
    bf16 = next((r for r in rows if r.setting.precision == "off" and "shares" in r.profile), None)
    if bf16 is not None:
        p = bf16.profile
        tables.insert(1, {"title": f"Profile of {bf16.setting.label} ({PROFILE_STEPS} steps, {p['source']} timeline "
                          f"{p['span_ms']:.0f} ms)", "columns": ["category", "share of timeline %"],
                          "rows": [[k, round(100 * v, 1)] for k, v in p["shares"].items()]})  # fmt: skip
        tables.insert(2, {"title": "Top kernels by total time (the profiled steps)",
                          "columns": ["kernel", "category", "calls", "total ms", "share of kernel time %"],
                          "rows": [[k["name"][:90], k["category"], k["calls"], round(k["total_ms"], 2),
                                    round(100 * k["share_of_kernel_time"], 1)] for k in p["top"]]})  # fmt: skip
    notes = [
        "Written by `benchmarks/gpu_throughput.py` (its --help says what each row measures): every row is "
        "`torchrun -m titanloop.train --config train_configs/debug.toml` with titanloop.checks.runs' overrides "
        "(synthetic text, AdamW with PyTorch's fused implementation, FSDP2, compile) plus the row's; MFU is the "
        "trainer's (titanloop.train.mfu), peak GiB torch.cuda.max_memory_allocated."
    ]
    if a.smoke:
        notes.insert(0, "SMOKE RUN on the CPU at tiny shapes (debug-tiny, gloo, no compile): the numbers are "
                        "meaningless; it shows every part runs.")  # fmt: skip
    return {"title": "GPU throughput", **meta, "summary": summary_rows(rows),
            "tables": tables, "notes": notes, "result": {"runs": [dataclasses.asdict(r) for r in rows]}}  # fmt: skip


# ----- command line -------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = runs.benchmark_parser("python benchmarks/gpu_throughput.py", __doc__, "throughput")
    what = p.add_mutually_exclusive_group()
    what.add_argument(
        "--setting", action="append", metavar="MB:AC:PREC[:T[:ACCUM]]", help="rows instead of the default"
    )
    what.add_argument("--full", action="store_true", help="micro-batch (1, 2, 4) x AC policy x precision")
    p.add_argument("--profile", action="store_true", help="profile every row 2 more steps (float8 against bf16)")
    p.add_argument("--steps", type=int, default=None, help=f"steps per row (default {STEPS}; --smoke 4)")
    p.add_argument("--warmup", type=int, default=None, help=f"first steps not measured (default {WARMUP}; --smoke 1)")
    p.add_argument("--compare-traces", nargs=2, type=Path, metavar=("BF16", "FLOAT8"), help="two kept traces, no run")
    p.add_argument("--artifacts", type=Path, default=Path("gpu_throughput_artifacts"), help="run logs and traces")
    a = p.parse_args(argv)
    try:
        a.settings = [parse_setting(t) for t in a.setting] if a.setting else None
    except ValueError as e:
        p.error(f"--setting {e}")
    a.steps = a.steps or (4 if a.smoke else STEPS)
    a.warmup = a.warmup if a.warmup is not None else (1 if a.smoke else WARMUP)
    if a.steps < 1 or not 0 <= a.warmup < a.steps:
        p.error(f"--steps {a.steps} --warmup {a.warmup}: expected 0 <= warmup < steps, so that some step is measured")
    a.preset, a.seq_len, a.vocab = ("debug-tiny", 64, 512) if a.smoke else ("ouro-1.4b", 4096, 49152)
    return a


def compare_traces_main(bf16: Path, float8: Path) -> int:
    """--compare-traces: float8_vs_bf16 of two kept traces, printed."""
    try:
        cmp = float8_vs_bf16(read_trace(bf16), read_trace(float8))
    except (OSError, ValueError, EOFError) as e:
        print(f"gpu_throughput: --compare-traces: cannot read the traces: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    for table in float8_tables(float8.name, {"bf16_row": bf16.name, **cmp}):
        print(table["title"], "\n  " + " | ".join(table["columns"]))
        print("\n".join("  " + " | ".join(str(x) for x in row) for row in table["rows"]))
    print(cmp["explanation"])
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--vs-dense" in argv:
        return vs_dense_main([x for x in argv if x != "--vs-dense"])
    a = parse_args(argv)
    if a.compare_traces:
        return compare_traces_main(*a.compare_traces)
    import torch

    if not a.smoke and not torch.cuda.is_available():
        print("gpu_throughput: no CUDA device (torch.cuda.is_available() is False): run it on a GPU, or --smoke")
        return 1
    runs.exit_on_sigterm()
    machine = f"1 x {torch.cuda.get_device_name(0)}" if not a.smoke else "CPU (smoke run: tiny shapes)"
    matrix = a.settings or (SMOKE_MATRIX if a.smoke else FULL_MATRIX if a.full else DEFAULT_MATRIX)
    rows = []
    with tempfile.TemporaryDirectory(prefix="gpu_throughput_") as work:
        for i, s in enumerate(matrix, 1):
            rows.append(run_setting(a, s, Path(work), i))
            r, what = rows[-1], f"{rows[-1].status}: {rows[-1].reason}"
            if r.status == "ok":
                what = (
                    f"{r.tokens_per_s_gpu:,.0f} tokens/s/GPU, MFU {'n/a' if r.mfu is None else f'{100 * r.mfu:.1f}%'}"
                )
            print(f"[{i}/{len(matrix)}] {s.label}: {what}", flush=True)
    attach_float8_comparisons(rows, a.artifacts)
    meta = {"command": shlex.join(["python", "benchmarks/gpu_throughput.py", *argv]), "commit": runs.git_commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
            "machine": f"{machine}, torch {torch.__version__}", "torch": torch.__version__}  # fmt: skip
    doc = result_json(rows, a, meta)
    a.out = runs.out_path(a, machine)
    for r in doc["summary"]:
        print(f"  {r['row']}: {r['measured']}" + (f" (target {r['target']})" if r["target"] else ""))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {a.out}; run logs and traces in {a.artifacts}")
    return 0


LOOPED_LAYERS, MICRO_BATCH, DENSE_STEPS, DENSE_WARMUP = 6, 2, 8, 3  # --vs-dense


def synthetic_doc_lengths(seq_len: int, vocab: int, rows: int = 32, seed: int = 0) -> list[int]:
    """Document lengths of the first `rows` rows of the synthetic_text stream the runs train on: the attention part
    of FLOPs per token depends on them."""
    import numpy as np

    from titanloop.data.synthetic_text import SyntheticTextSource

    source, lengths = SyntheticTextSource(seq_len, vocab, seed, motif_vocab=runs.MOTIF_VOCAB), []
    for k in range(rows):
        lengths += [int(n) for n in np.unique(source.row(k).doc_ids[:seq_len], return_counts=True)[1]]
    return lengths


def dense_layers_for(looped: LoopLMConfig, seq_len: int, n_loops: int, doc_lengths=None) -> int:
    """The layer count of a dense model of the looped model's width (T = 1, one readout) whose FLOPs per token are
    closest to the looped model's at T = n_loops."""
    target = looped.flops_per_token(seq_len, n_loops=n_loops, doc_lengths=doc_lengths)

    def dense(n: int) -> float:
        return looped.replace(n_layers=n, n_loops=1).flops_per_token(seq_len, n_loops=1, doc_lengths=doc_lengths)

    return min(range(1, 4 * looped.n_layers * n_loops + 1), key=lambda n: abs(dense(n) - target))


def dense_throughput(rows: list[dict], warmup: int) -> dict:
    """Medians over torchtitan's logged steps after `warmup` (the harness's JSONL of its MetricsProcessor)."""
    used = [r for r in rows if r["step"] > warmup and "throughput(tps)" in r]
    if not used:
        raise ValueError(f"no logged step after the warm-up ({warmup} steps) to measure ({len(rows)} rows logged)")
    peaks = [r["memory/max_active(GiB)"] for r in rows if r.get("memory/max_active(GiB)", 0) > 0]
    return {
        "tokens_per_s_gpu": statistics.median(r["throughput(tps)"] for r in used),
        "peak_gib": max(peaks) if peaks else None,
        "torchtitan_mfu": statistics.median(r.get("mfu(%)", 0) for r in used) / 100,  # its count: full-square attention
    }


def run_titanloop(a, work: Path, name: str, n_layers: int, n_loops: int) -> dict:
    run_dir, log = work / name, work / f"{name}.log"
    args = runs.train_args(
        run_dir, a.preset, {"n_layers": n_layers}, n_loops, a.seq_len, 1, "bf16", a.steps, MICRO_BATCH, "none"
    )
    args += ["--metrics.log_freq", "1", "--metrics.breakdown", "false", "--model.vocab_size", str(a.vocab)]
    args += ["--lr_scheduler.warmup_steps", "2", "--parallelism.compile", str(not a.smoke).lower()]
    code = runs.run(torchrun(1, "-m", "titanloop.train", "--config", str(runs.TRAIN_CONFIG), *args), log, None)
    if code != 0:
        return {"status": "failed", "reason": runs.failure(code, log)}
    return {"status": "ok", **runs.median_throughput(runs.metrics(run_dir), a.warmup)}


def run_torchtitan(a, work: Path, name: str, n_layers: int) -> dict:
    cfg = preset(a.preset, vocab_size=a.vocab)
    folder = work / name
    spec = DenseSpec(
        dump_folder=str(folder), metrics_jsonl=str(folder / "metrics.jsonl"), n_layers=n_layers, dim=cfg.hidden_size,
        n_heads=cfg.n_heads, ffn_hidden_size=cfg.ffn_hidden_size, vocab_size=cfg.vocab_size, rope_theta=cfg.rope_theta,
        seq_len=a.seq_len, local_batch_size=MICRO_BATCH, steps=a.steps, lr=1e-3, warmup_steps=2, compile=not a.smoke,
        attn_backend="sdpa" if a.smoke else "flex", motif_vocab=runs.MOTIF_VOCAB,
    )  # fmt: skip
    folder.mkdir(parents=True)
    env = {**runs.environment(), SPEC_ENV: spec.to_env()}
    log = work / f"{name}.log"
    code = runs.run(torchrun(1, str(ROOT / "benchmarks" / "torchtitan_dense.py")), log, None, env)
    if code != 0:
        return {"status": "failed", "reason": runs.failure(code, log)}
    try:
        return {"status": "ok", **dense_throughput(runs.metrics(folder), a.warmup)}
    except ValueError as e:
        return {"status": "failed", "reason": str(e)}


def parse_vs_dense_args(argv):
    p = runs.benchmark_parser("python benchmarks/gpu_throughput.py --vs-dense", __doc__, "looped-vs-dense")
    p.add_argument("--launches", type=int, default=2, help="launches of each run (default 2)")
    p.add_argument("--steps", type=int, default=DENSE_STEPS, help=f"steps per run (default {DENSE_STEPS})")
    a = p.parse_args(argv)
    if a.launches < 1 or a.steps < 2:
        p.error(f"--launches {a.launches} --steps {a.steps}: expected at least 1 launch and 2 steps")
    a.warmup = min(DENSE_WARMUP, a.steps - 1)
    a.preset, a.seq_len, a.vocab = ("debug-tiny", 64, 512) if a.smoke else ("ouro-1.4b", 4096, 49152)
    return a


def vs_dense_main(argv: list[str]) -> int:
    """--vs-dense: the looped model against torchtitan's dense one at equal FLOPs per token."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    a = parse_vs_dense_args(argv)
    import torch

    if not a.smoke and not torch.cuda.is_available():
        print(
            "gpu_throughput --vs-dense: no CUDA device (torch.cuda.is_available() is False): run on a GPU, or --smoke"
        )
        return 1
    runs.exit_on_sigterm()
    looped_layers = 2 if a.smoke else LOOPED_LAYERS
    lengths = synthetic_doc_lengths(a.seq_len, a.vocab)
    looped = preset(a.preset, vocab_size=a.vocab, n_layers=looped_layers)
    layers = dense_layers_for(looped, a.seq_len, 4, lengths)
    flops = {
        "looped": looped.flops_per_token(a.seq_len, n_loops=4, doc_lengths=lengths),
        "dense": looped.replace(n_layers=layers).flops_per_token(a.seq_len, n_loops=1, doc_lengths=lengths),
    }
    peak = peak_flops(device_name("cuda")) if not a.smoke else None
    rows, ratios = [], []
    with tempfile.TemporaryDirectory(prefix="looped_vs_dense_") as tmp:
        for launch in range(1, a.launches + 1):
            lr = run_titanloop(a, Path(tmp), f"looped-{launch}", looped_layers, 4)
            dr = run_torchtitan(a, Path(tmp), f"torchtitan-{launch}", layers)
            pair = [(f"titanloop looped, {looped_layers} layers x T=4", "looped", lr)]
            pair.append((f"torchtitan dense llama3, {layers} layers", "dense", dr))
            if dr["status"] != "ok":  # the baseline falls back to titanloop's own dense model
                tl = run_titanloop(a, Path(tmp), f"titanloop-dense-{launch}", layers, 1)
                pair.append((f"titanloop dense, {layers} layers x T=1", "dense", tl))
            base = pair[-1][2]
            if lr["status"] == "ok" and base["status"] == "ok":
                ratios.append(lr["tokens_per_s_gpu"] / base["tokens_per_s_gpu"])
            rows += [[f"{label}, launch {launch}", kind, r] for label, kind, r in pair]
            print(f"launch {launch}: " + "; ".join(f"{label}: {r.get('tokens_per_s_gpu', r.get('reason'))}"
                                                for label, _, r in pair), flush=True)  # fmt: skip
    f = lambda x, spec: "" if x is None else format(x, spec)  # noqa: E731
    table = []
    for label, kind, r in rows:
        achieved = r.get("tokens_per_s_gpu", 0) * flops[kind]
        status = r["status"] + (f": {r['reason']}"[:160] if r.get("reason") else "")
        table.append([label, f(flops[kind] / 1e9, ".4g"), f(r.get("tokens_per_s_gpu"), ",.0f"),
                      f(achieved and achieved / 1e12, ".1f"), f(peak and achieved and 100 * achieved / peak, ".1f"),
                      f(r.get("peak_gib"), ".1f"), status])  # fmt: skip
    measured = round(statistics.median(ratios), 3) if ratios else "not measured (a run failed: see the table)"
    summary = {"row": f"looped / dense tokens/s ({looped_layers} layers x T=4 vs {layers} layers, equal FLOPs/token; "
               f"median of {len(ratios)} launch pairs: {', '.join(f'{x:.3f}' for x in ratios)})",
               "measured": measured, "target": ">= 1.0", "met": measured >= 1.0 if ratios else None}  # fmt: skip
    doc = {
        "title": "Looped vs dense at equal FLOPs per token", "torch": torch.__version__,
        "command": shlex.join(["python", "benchmarks/gpu_throughput.py", "--vs-dense", *argv]),
        "commit": runs.git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "machine": (f"1 x {torch.cuda.get_device_name(0)}" if not a.smoke else "CPU (smoke run)")
        + f", torch {torch.__version__}",
        "summary": [summary],
        "tables": [{"title": f"Runs ({a.preset} width, {MICRO_BATCH} x {a.seq_len} tokens, no AC, bf16; MFU by the "
                    "trainer's count over the documents, attended keys per token "
                    f"{attended_keys_per_token(a.seq_len, lengths):.0f})",
                    "columns": ["run", "GFLOP/token", "tokens/s/GPU", "TFLOP/s", "MFU %", "peak GiB", "status"],
                    "rows": table}],
        "notes": ["Differences that remain between the two trainers: torchtitan's FlexAttention (document mask) "
                  "against torch's varlen flash kernel, a plain (not chunked) cross-entropy, no sandwich norms, no "
                  "per-loop readouts. torchtitan's own MFU counts full-square attention."],
        "result": {"flops_per_token": flops, "ratios": ratios, "runs": rows},
    }  # fmt: skip
    a.out = runs.out_path(a, doc["machine"])
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{summary['row']}: {measured}\nwrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
