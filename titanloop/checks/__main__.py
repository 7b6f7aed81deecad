"""`python -m titanloop.checks` (or `bash scripts/gpu_check.sh`): the acceptance check of a GPU node or cluster, from
one node with 1-8 GPUs. It prints a PASS / FAIL / n/a table and writes a json (--out) with every row's numbers,
the device, the torch version and the commit; exit status 0 only if every row asked for ran and none failed.

Rows (--rows, comma-separated; default all, in this order):
  plans       the memory plan (the dry run's, titanloop.train.memory_plan) of every training run below, at this
              node's GPU count (--gpus without CUDA): planned peak per GPU. Needs no GPU, so a CPU machine can
              compute them ahead (`--rows plans --out plans.json`) and the GPU node reuse them (--plans plans.json)
  numerics    in-process on GPU 0, each against a float64 or fp32 reference (tolerances: docs/scaling.md):
                flash-attn       importable (optional: n/a without it, attention uses torch's kernels)
                attention docs   document-masked bf16 attention as the model calls it, and its kernel
                attention plain  plain causal bf16 attention
                bf16 logits      a LoopLM trained in fp32, its last-loop logits in bf16 vs fp32
                compile          the per-layer compiled LoopLM over T x document counts: 0 graph breaks, no recompiles
                readout          the recompute readout in bf16 vs full fp32 logits: values and gradients
                readout fused    the default fused readout (objective.ce_backward = "fused"), the same rule
                fused vs recompute  seconds and peak memory of both readouts at a training shape (reported)
  kernels     kernel choice: a 2-step compiled `torchrun -m titanloop.train` records the attention kernel of every
              forward: all bf16, on CUDA, none on a fallback kernel
  train       `torchrun -m titanloop.train` on all local GPUs (FSDP2, bf16 parameters, compile, per-loop AC,
              document masking) for --steps steps on synthetic text whose motifs use 63 ids of the 49K vocabulary,
              at each T of --loops and each of --precisions (bf16, float8 tensorwise and rowwise), then bf16 at
              T = 4 without AC for 5 steps, compiled and eager (--no-memory-runs: not). Per run:
                train ...        tokens/s/GPU, MFU (the trainer's: titanloop.train.mfu), loss first -> last
                memory plan ...  peak memory (torch.cuda.max_memory_allocated) within 15% of the plan
              and per float8 run:
                float8 ... loss  at most 3% above bf16's at the same T, judged once bf16's loss fell by 10%
                float8 ... speed tokens/s against bf16's: tensorwise must be >= 1.0x, rowwise is reported
  preemption  a small run saving asynchronously every 5 steps (pinned-memory staging on CUDA) is stopped by
              SIGTERM after 12 steps and resumed; its losses after the resume vs an uninterrupted run's: bitwise
              when two uninterrupted runs agree bitwise, else within 2x their difference
  eval        train_configs/debug.toml trained here with held-out validation, in bf16 and in fp32; its last
              validation vs `python -m titanloop.eval sweep` on the checkpoint of that step, in the same dtype
              (bf16: within 2x the distance of each from fp32, plus a rounding floor; fp32: 1e-5 relative)

The training shape is the largest of ouro-1.4b (24 layers), 12 and 4 of its layers, debug-small that fits the
smallest free GPU memory (--shape chooses). Without CUDA the rows that need a GPU are n/a, one line says which,
and the exit status is 1; `--rows plans` needs none. `--smoke` runs every row's orchestration on the CPU at tiny
sizes (its numbers and most verdicts mean nothing). `--time-limit S` stops a run still going after S seconds in
all and leaves the rows after it n/a; the json is rewritten after every row, so a stopped check still reports.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import shlex
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from titanloop.checks import numerics as nm
from titanloop.checks import runs
from titanloop.checks.numerics import Check
from titanloop.cli import check_output
from titanloop.config_errors import ConfigError
from titanloop.checks.verdicts import (
    RunResult,
    float8_checks,
    format_table,
    loss_window,
    memory_plan_check,
    preemption_verdict,
    validation_check,
    verdict,
)
from titanloop.model.config import preset
from titanloop.train.launch import torchrun

ROWS = ("plans", "numerics", "kernels", "train", "preemption", "eval")
GIB = 1024**3
# (preset, overrides) from the largest down: the first whose training state plus ACTIVATION_ALLOWANCE fits
SHAPES = [("ouro-1.4b", {}), ("ouro-1.4b", {"n_layers": 12}), ("ouro-1.4b", {"n_layers": 4}), ("debug-small", {})]
ACTIVATION_ALLOWANCE = 16 * GIB
MEMORY_STEPS = 5  # the memory runs (bf16, T = 4, no AC): long enough for the optimizer step's peak
PREEMPT_STEPS, PREEMPT_AT, PREEMPT_INTERVAL = 30, 12, 5
VAL_LOOPS, VAL_QS = [1, 2, 3, 4, 8], [0.5, 0.8, 0.9]  # debug.toml trains T = 4: 1..T and 2T
VAL_T_TRAIN = 4  # validation's exit depth and Q-exit are over the trained depth; the CLI's default is the deepest T


@dataclass(frozen=True)
class RunSpec:
    """One training run: T, precision, AC policy, steps, compiled or eager."""

    n_loops: int
    precision: str
    ac: str = "loop"
    steps: int = 60
    compiled: bool = True

    @property
    def label(self) -> str:
        ac = "" if self.ac == "loop" else f" AC {self.ac}"
        return f"T={self.n_loops} {self.precision}{ac}" + ("" if self.compiled else " eager")


class Checks:
    """The run's state: its options, the rows so far (rewritten to --out after each) and the time limit."""

    def __init__(self, a: argparse.Namespace, meta: dict):
        self.a, self.meta, self.checks, self.runs, self.plans = a, meta, [], [], {}
        self.start = time.monotonic()

    def left(self) -> float | None:
        return None if self.a.time_limit is None else self.a.time_limit - (time.monotonic() - self.start)

    def out_of_time(self, label: str) -> bool:
        """Whether --time-limit has passed; if so `label` is an n/a row, remembered as not run."""
        if self.left() is None or self.left() > 0:
            return False
        self.meta["not_run"].append(label)
        self.add(Check(label, None, "not run: --time-limit reached"))
        return True

    def add(self, *new: Check) -> None:
        """Print the new rows and rewrite --out: a check stopped from outside still leaves what it finished."""
        for c in new:
            self.checks.append(c)
            print(format_table([c]).splitlines()[-1], flush=True)
        self.meta["seconds"] = round(time.monotonic() - self.start, 1)
        self.a.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.a.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(result_json(self.checks, self.runs, self.plans, self.meta), indent=1) + "\n")
        os.replace(tmp, self.a.out)


# ----- shapes, run arguments and plans ------------------------------------------------------------------------
def state_bytes(name: str, overrides: dict, n_gpus: int) -> float:
    """Training state per GPU: fp32 params + grads + two Adam moments (16 B/param) sharded by FSDP2, plus the looped
    stack held gathered in bf16 through the step (reshard_looped = "never")."""
    cfg = preset(name, **overrides)
    return 16 * cfg.param_count() / n_gpus + 2 * cfg.layer_params() * (cfg.n_layers + cfg.n_coda_layers)


def pick_shape(free_bytes: float, n_gpus: int) -> tuple[str, dict]:
    """The largest of SHAPES whose training state plus ACTIVATION_ALLOWANCE fits in `free_bytes`."""
    fitting = (s for s in SHAPES if state_bytes(*s, n_gpus) + ACTIVATION_ALLOWANCE <= free_bytes)
    return next(fitting, SHAPES[-1])


def training_runs(a: argparse.Namespace) -> list[RunSpec]:
    """T x precision with per-loop AC, then (unless --no-memory-runs) bf16 at T = 4 without AC, compiled and eager:
    the plan subtracts compile's saving for the compiled one only, so the pair checks it with and without."""
    specs = [RunSpec(t, p, "loop", a.steps) for t, p in itertools.product(a.loops, a.precisions)]
    if not a.no_memory_runs:
        specs += [RunSpec(4, "bf16", "none", MEMORY_STEPS), RunSpec(4, "bf16", "none", MEMORY_STEPS, False)]
    return specs


def run_args(a: argparse.Namespace, spec: RunSpec, run_dir: Path) -> list[str]:
    args = runs.train_args(
        run_dir, a.shape, a.model, spec.n_loops, a.seq_len, a.gpus, spec.precision, spec.steps, a.micro_batch, spec.ac
    )
    # --smoke: eager (torchao's float8 emulation on the CPU runs eager only)
    return args + (["--parallelism.compile", "false"] if not spec.compiled or a.smoke else [])


def plan_key(args: list[str], n_gpus: int) -> str:
    """What a memory plan depends on: the run's arguments without its run dir, and the GPU count."""
    i = args.index("--training.run_dir")
    return json.dumps([n_gpus, args[:i] + args[i + 2 :]])


def planned_gib(args: list[str], n_gpus: int) -> float:
    """The dry run's memory plan of TRAIN_CONFIG + `args` at `n_gpus` ranks (fake backend): its peak in GiB."""
    from titanloop.train.dry_run import planned_peak_bytes  # the trainer loads torch: only when a plan is made

    return planned_peak_bytes(runs.TRAIN_CONFIG, args, n_gpus) / GIB


def row_plans(c: Checks) -> None:
    """Each training run's plan: from --plans when it holds the run's key, else planned here."""
    a = c.a
    for spec in training_runs(a):
        key = plan_key(run_args(a, spec, Path("x")), a.gpus)
        if key in c.plans:
            gib, where = c.plans[key]["gib"], f"planned before, at {c.plans[key]['commit'][:10]}"
        else:
            started = time.perf_counter()
            gib = planned_gib(run_args(a, spec, Path("x")), a.gpus)
            c.plans[key] = {"gib": gib, "commit": c.meta["commit"], "label": spec.label}
            where = f"planned in {time.perf_counter() - started:.0f} s"
        fits = "" if a.free_bytes is None else f"; {a.free_bytes / GIB:.1f} GiB free"
        c.add(Check(f"plan {spec.label}", None, f"{a.shape_text}: {gib:.2f} GiB per GPU ({where}){fits}"))


# ----- the rows on a GPU --------------------------------------------------------------------------------------
def row_numerics(c: Checks) -> None:
    import torch

    doc_ids = torch.tensor([[0] * 300 + [1] * 700 + [2] * 24, [0] * 1024])

    def flash() -> Check:
        from titanloop.model.attention import flash_available  # loads torch: only on the GPU rows

        why = "not installed (optional: attention uses torch's kernels; pip install 'titanloop[gpu]')"
        return Check("flash-attn", True, "importable") if flash_available() else Check("flash-attn", None, why)

    def fused_vs_recompute() -> Check:
        r = nm.fused_readout_comparison("cuda")
        s, b = r["seconds"], r["peak_bytes"]
        detail = f"fused {s['fused']:.3f} s, {b['fused'] / GIB:.2f} GiB vs recompute {s['recompute']:.3f} s, "
        detail += f"{b['recompute'] / GIB:.2f} GiB; max rel diff {max(r['max_rel_err'].values()):.1e}"
        return Check("fused vs recompute", None, detail, r)

    for label, fn in [
        ("flash-attn", flash),
        ("attention docs", lambda: nm.attention_check("attention docs", "cuda", doc_ids)),
        ("attention plain", lambda: nm.attention_check("attention plain", "cuda")),
        ("bf16 logits", lambda: nm.bf16_logits_check("cuda")),
        ("compile", lambda: nm.compile_check("cuda")),
        ("readout", lambda: nm.readout_check("cuda")),
        ("readout fused", lambda: nm.readout_check("cuda", fused=True)),
        ("fused vs recompute", fused_vs_recompute),
    ]:
        if c.out_of_time(label):
            return
        try:
            c.add(fn())
        except Exception as e:  # noqa: BLE001 - a failing check is a FAIL row, the others still run
            c.add(Check(label, False, f"{type(e).__name__}: {e}"[:200]))


def row_kernels(c: Checks, work: Path) -> None:
    out, log = work / "kernels.json", work / "kernels.log"
    args = runs.train_args(work / "kernels", c.a.shape, {**c.a.model, "n_layers": 2}, 4, 1024, 1, steps=2)
    cmd = torchrun(1, "-m", "titanloop.checks", "--record-kernels", str(out), "--config", str(runs.TRAIN_CONFIG), *args)
    code = runs.run(cmd, log, c.left())
    if code != 0 or not out.is_file():
        return c.add(Check("kernel choice", False, runs.failure(code, log)))
    c.add(nm.kernel_choice_check(json.loads(out.read_text())))


def row_train(c: Checks, work: Path) -> None:
    a = c.a
    for spec in training_runs(a):
        run_dir = work / f"T{spec.n_loops}-{spec.precision}-{spec.ac}{'' if spec.compiled else '-eager'}"
        args = run_args(a, spec, run_dir)
        res = RunResult(spec.n_loops, spec.precision, spec.ac, spec.compiled)
        c.runs.append(res)
        label, plan = f"train {spec.label}", c.plans.get(plan_key(args, a.gpus), {}).get("gib")
        res.plan_gib = plan
        if c.out_of_time(label):
            res.error, res.skipped = "not run: --time-limit reached", True
            continue
        if runs.missing_modules(spec.precision):
            res.error = f"{sys.executable} cannot import {runs.missing_modules(spec.precision)}"
        elif plan is not None and a.free_bytes is not None and plan * GIB > a.free_bytes:
            res.error, res.skipped = f"not run: its plan is {plan:.2f} GiB, {a.free_bytes / GIB:.1f} GiB free", True
        if res.error:
            c.add(Check(label, None if res.skipped else False, res.error))
            continue
        log = work / f"{run_dir.name}.log"
        code = runs.run(
            torchrun(a.gpus, "-m", "titanloop.train", "--config", str(runs.TRAIN_CONFIG), *args), log, c.left()
        )
        rows = runs.metrics(run_dir)
        if code is None:  # stopped at --time-limit: not the node's failure
            res.error, res.skipped = runs.failure(code, log), True
            c.meta["not_run"].append(label)
            c.add(Check(label, None, res.error))
            continue
        if code != 0 or not rows:
            res.error = runs.failure(code, log) if code != 0 else f"no metrics logged: {runs.failure(0, log)}"
            c.add(Check(label, False, res.error))
            continue
        m = runs.median_throughput(rows, warmup=1 if len(rows) > 1 else 0, n_gpus=a.gpus)
        res.tokens_per_s_gpu, res.mfu, res.peak_gib = m["tokens_per_s_gpu"], m["mfu"], m["peak_gib"]
        res.loss_first, res.loss_last = loss_window(rows)
        mfu = "n/a" if res.mfu is None else f"{100 * res.mfu:.1f}%"
        detail = f"{a.shape_text} {res.tokens_per_s_gpu:,.0f} tokens/s/GPU, MFU {mfu}, loss {res.loss_first:.3f} -> "
        c.add(Check(label, True, detail + f"{res.loss_last:.3f}", m))
        if res.peak_gib is not None:  # (the CPU logs no peak: --smoke)
            c.add(memory_plan_check(f"memory plan {spec.label}", res.peak_gib, plan))
    c.add(*float8_checks(c.runs))


def _preempt_args(run_dir: Path) -> list[str]:
    return [
        *runs.train_args(run_dir, "debug-small", {}, 4, 1024, 1, steps=PREEMPT_STEPS),
        *("--metrics.log_freq", "1", "--parallelism.compile", "false", "--checkpoint.enable", "true"),
        *("--checkpoint.interval", str(PREEMPT_INTERVAL), "--checkpoint.mode", "async", "--data.motif_vocab", "0"),
    ]


def row_preemption(c: Checks, work: Path) -> None:
    """Reference, repeat, and a run SIGTERMed after PREEMPT_AT logged steps, then resumed in the same run dir."""
    dirs = {k: work / f"preempt-{k}" for k in ("ref", "rep", "cut")}
    logs = {k: work / f"preempt-{k}.log" for k in dirs}

    def cmd(k: str) -> list[str]:
        return torchrun(1, "-m", "titanloop.train", "--config", str(runs.TRAIN_CONFIG), *_preempt_args(dirs[k]))

    for k in ("ref", "rep"):
        code = runs.run(cmd(k), logs[k], c.left())
        if code != 0:
            return c.add(Check("preemption", False, f"uninterrupted run: {runs.failure(code, logs[k])}"))
    cut = runs.start(cmd("cut"), logs["cut"])
    deadline = time.monotonic() + (c.left() or 600)
    while len(runs.metrics(dirs["cut"])) < PREEMPT_AT and cut.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    cut.send_signal(signal.SIGTERM)  # torchrun forwards it; the trainer saves (async on CUDA) and exits 75
    runs.wait(cut, c.left())
    out = logs["cut"].read_text()
    if "preempted at step " not in out:
        return c.add(Check("preemption", False, f"the stopped run did not save and exit (exit {cut.returncode})"))
    resumed_from = int(out.split("preempted at step ")[1].split()[0])
    code = runs.run(cmd("cut"), logs["cut"], c.left())
    if code != 0:
        return c.add(Check("preemption", False, f"the resumed run: {runs.failure(code, logs['cut'])}"))
    c.add(preemption_verdict(*(runs.metrics(dirs[k]) for k in ("ref", "rep", "cut")), resumed_from))


def _eval_cli(c: Checks, work: Path, ckpt: Path, dtype: str, tag: str) -> dict:
    """`python -m titanloop.eval sweep` on the validation's held-out data (debug.toml's synthetic text, seed + 1)."""
    spec, out, log = work / "val_data.json", work / f"eval_{tag}", work / f"eval_{tag}.log"
    spec.write_text(json.dumps({"kind": "synthetic_text", "seed": 1}))
    cmd = [sys.executable, "-m", "titanloop.eval", "sweep", str(ckpt), "--data", str(spec), "--out", str(out)]
    cmd += ["--device", c.a.device, "--dtype", dtype, "--batch-size", str(c.a.val_batch), "--seq-len", "64"]
    cmd += ["--max-batches", str(c.a.val_steps), "--loops", ",".join(map(str, VAL_LOOPS)), "--jsrr-loops", "1"]
    cmd += ["--q", ",".join(map(str, VAL_QS)), "--exit-loops", str(VAL_T_TRAIN)]
    code = runs.run(cmd, log, c.left())
    if code != 0:
        raise RuntimeError(f"the eval CLI: {runs.failure(code, log)}")
    return json.loads((out / "report.json").read_text())


def row_eval(c: Checks, work: Path) -> None:
    steps = c.a.eval_steps
    for dtype in ("bfloat16", "float32"):
        label, run_dir, log = f"eval {dtype}: validation == CLI", work / f"val_{dtype}", work / f"val_{dtype}.log"
        if c.out_of_time(label):
            continue
        args = ["--training.run_dir", str(run_dir), "--training.steps", str(steps), "--training.dtype", dtype]
        # per-document SDPA for the packed held-out text in both dtypes and every process: float32 on CUDA would
        # otherwise take FlexAttention, compiled anew by the trainer and by each CLI run (minutes)
        args += ["--model.attention_backend", "sdpa_per_doc", "--metrics.log_freq", str(steps)]
        args += ["--checkpoint.enable", "true", "--checkpoint.interval", str(steps), "--checkpoint.mode", "sync"]
        args += ["--validation.enable", "true", "--validation.freq", str(steps), "--validation.steps"]
        args += [str(c.a.val_steps), "--validation.batch_size", str(c.a.val_batch)]
        args += ["--validation.loops", json.dumps(VAL_LOOPS), "--validation.q", json.dumps(VAL_QS)]
        args += ["--metrics.wandb", "off"]
        try:
            code = runs.run(
                torchrun(1, "-m", "titanloop.train", "--config", str(runs.TRAIN_CONFIG), *args), log, c.left()
            )
            if code != 0:
                raise RuntimeError(f"training: {runs.failure(code, log)}")
            val = [r for r in runs.metrics(run_dir) if "val/tokens" in r][-1]
            ckpt = run_dir / "checkpoints" / f"step-{steps:08d}"
            cli = _eval_cli(c, work, ckpt, dtype, dtype)
            fp32 = cli if dtype == "float32" else _eval_cli(c, work, ckpt, "float32", f"{dtype}_fp32")
            c.add(validation_check(dtype, val, cli, fp32, VAL_LOOPS, VAL_QS))
        except (RuntimeError, OSError, KeyError, IndexError, ValueError) as e:
            c.add(Check(label, False, f"{type(e).__name__}: {e}"[:240]))


# ----- the json -------------------------------------------------------------------------------------------------
def result_json(checks: list[Check], results: list[RunResult], plans: dict, meta: dict) -> dict:
    """The json in benchmarks/report.py's schema (renderable into BENCHMARKS.md once committed), with every check
    and run under "result" and the memory plans under "plans" (what --plans reads back)."""
    judged = [c for c in checks if c.ok is not None]
    summary = [{"row": "checks passed", "measured": f"{sum(c.ok for c in judged)}/{len(judged)}", "target": "all"}]
    summary[0]["met"] = bool(judged) and all(c.ok for c in judged) and not meta.get("not_run")
    by = {(r.n_loops, r.precision): r for r in results if r.ac == "loop" and r.compiled and r.tokens_per_s_gpu}
    if (4, "bf16") in by:
        base = by[4, "bf16"]
        summary.append({"row": f"tokens/s/GPU, T=4, bf16 ({meta['shape']})", "measured": round(base.tokens_per_s_gpu)})
        if base.mfu is not None:
            summary.append({"row": "MFU, T=4, bf16", "measured": round(base.mfu, 4)})
        if (4, "tensorwise") in by:
            ratio = round(by[4, "tensorwise"].tokens_per_s_gpu / base.tokens_per_s_gpu, 3)
            summary.append({"row": "float8 tensorwise / bf16 tokens/s, T=4", "measured": ratio, "target": ">= 1.0"})
            summary[-1]["met"] = ratio >= 1.0
    tables = [{"title": "Checks", "columns": ["check", "result", "detail"]}]
    tables[0]["rows"] = [[c.name, verdict(c), c.detail] for c in checks]
    if results:
        f = lambda x, spec: "" if x is None else format(x, spec)  # noqa: E731
        columns = ["T", "precision", "AC", "tokens/s/GPU", "MFU %", "peak GiB", "plan GiB", "loss first -> last"]
        rows = [
            [r.n_loops, r.precision, r.ac + ("" if r.compiled else ", eager"), f(r.tokens_per_s_gpu, ",.0f"),
             f(r.mfu and 100 * r.mfu, ".1f"), f(r.peak_gib, ".2f"), f(r.plan_gib, ".2f"),
             "" if r.loss_first is None else f"{r.loss_first:.3f} -> {r.loss_last:.3f}"]
            for r in results
        ]  # fmt: skip
        title = f"Training runs ({meta['shape']}, {meta['seq_len']} tokens/sequence, {meta['steps']} steps)"
        tables.append({"title": title, "columns": columns, "rows": rows})
    return {
        "title": f"GPU check, {meta['date']}, {meta['n_gpus']} x {meta['device']} (torch {meta['torch']})",
        "command": meta["command"],
        "date": meta["date"],
        "commit": meta["commit"],
        "machine": f"{meta['n_gpus']} x {meta['device']}, torch {meta['torch']}",
        "torch": meta["torch"],
        "summary": [{"target": None, "met": None, **r} for r in summary],
        "tables": tables,
        "notes": ["Written by `python -m titanloop.checks` (its --help explains every row; tolerances: "
                  "docs/scaling.md). MFU is the trainer's: the device's bf16 dense peak, float8 runs included."],
        "plans": plans,
        "result": {**meta, "checks": [asdict(c) for c in checks], "runs": [asdict(r) for r in results]},
    }  # fmt: skip


# ----- command line ---------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m titanloop.checks",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--rows", default=",".join(ROWS), help=f"the rows to run, some of {','.join(ROWS)} (default all)")
    p.add_argument("--loops", default="4", help="T of the training runs, comma-separated (default 4; e.g. 4,8)")
    p.add_argument("--precisions", default="bf16,tensorwise,rowwise", help="of the training runs (default all three)")
    p.add_argument("--steps", type=int, default=None, help="steps of each training run (default 60; --smoke 3)")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per GPU per step of the training runs")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence of the training runs (4096)")
    p.add_argument("--no-memory-runs", action="store_true", help="no bf16 T = 4 runs without AC")
    p.add_argument("--shape", default=None, help="model preset of the training runs (default: the largest that fits)")
    p.add_argument("--gpus", type=int, default=None, help="GPUs the plans are for without CUDA (default 1)")
    p.add_argument("--plans", type=Path, default=None, help="reuse the memory plans of an earlier json (--out)")
    p.add_argument("--time-limit", type=float, default=None, help="seconds for the whole check (default: none)")
    p.add_argument(
        "--out",
        type=Path,
        default=Path("runs/titanloop_checks.json"),
        help="the json (default %(default)s; an existing file is refused unless --overwrite; as a dated record: "
        "benchmarks/results/<date>-<device>-check.json)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.add_argument("--smoke", action="store_true", help="every row's orchestration on the CPU at tiny sizes")
    a = p.parse_args(argv)
    a.rows = [r.strip() for r in a.rows.split(",") if r.strip()]
    if not a.rows or set(a.rows) - set(ROWS):
        p.error(f"--rows {','.join(a.rows)!r}: expected some of {','.join(ROWS)}")
    try:
        a.loops = [int(t) for t in a.loops.split(",")]
        assert all(t >= 1 for t in a.loops)
    except (ValueError, AssertionError):
        p.error(f"--loops {a.loops!r}: expected comma-separated integers >= 1, e.g. --loops 4,8")
    a.precisions = a.precisions.split(",")
    if set(a.precisions) - set(runs.PRECISIONS) or "bf16" not in a.precisions:
        p.error(
            f"--precisions {','.join(a.precisions)}: bf16 and any of tensorwise, rowwise (float8 is judged by bf16)"
        )
    a.steps = a.steps if a.steps is not None else (3 if a.smoke else 60)
    a.seq_len = a.seq_len or (256 if a.smoke else 4096)
    for flag, value in (("--steps", a.steps), ("--micro-batch", a.micro_batch), ("--seq-len", a.seq_len)):
        if value < 1:
            p.error(f"{flag} {value}: expected an integer >= 1")
    if a.time_limit is not None and a.time_limit <= 0:
        p.error(f"--time-limit {a.time_limit:g}: expected seconds > 0")
    if a.plans is not None:
        try:
            a.plan_records = json.loads(a.plans.read_text())["plans"]
        except (OSError, ValueError, KeyError, TypeError):
            p.error(f"--plans {a.plans}: not a json with memory plans (write one: --rows plans --out FILE)")
    return a


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--record-kernels"]:  # inside the kernel-choice run's torchrun worker
        return record_kernels_main(argv[1], argv[2:])
    a = parse_args(argv)
    try:  # before anything runs: an earlier check's json is not replaced unasked (nor --plans, which it reads)
        check_output(a.out, "--out", overwrite=a.overwrite, kind="file", inputs=[("--plans", a.plans)])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import torch

    cuda = torch.cuda.is_available() and not a.smoke
    a.device = "cuda" if cuda else "cpu"
    if cuda:
        a.gpus, device = torch.cuda.device_count(), torch.cuda.get_device_name(0)
        a.free_bytes = min(torch.cuda.mem_get_info(i)[0] for i in range(a.gpus))
    else:
        a.gpus, device, a.free_bytes = a.gpus or 1, "CPU" + (" (--smoke: tiny sizes)" if a.smoke else ""), None
    name, a.model = (a.shape, {}) if a.shape else ("debug-tiny", {}) if a.smoke else (
        pick_shape(a.free_bytes, a.gpus) if cuda else SHAPES[0])  # fmt: skip
    a.shape, a.shape_text = name, name + "".join(f" {k}={v}" for k, v in a.model.items())
    a.eval_steps, a.val_steps, a.val_batch = (6, 2, 4) if a.smoke else (200, 8, 8)
    runnable = a.rows if cuda or a.smoke else [r for r in a.rows if r == "plans"]
    not_run = [r for r in a.rows if r not in runnable]
    meta = {"device": device, "n_gpus": a.gpus, "torch": torch.__version__, "cuda": torch.version.cuda}
    meta.update(commit=runs.git_commit(), shape=a.shape_text, seq_len=a.seq_len, steps=a.steps, rows=a.rows)
    meta.update(command=shlex.join(["python", "-m", "titanloop.checks", *argv]), not_run=not_run)
    meta["date"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    c = Checks(a, meta)
    c.plans = dict(getattr(a, "plan_records", {}))
    print(f"titanloop.checks: {a.gpus} x {device}, torch {torch.__version__}, {a.shape_text}, rows {','.join(a.rows)}")
    if not_run:
        print(f"no CUDA device: {', '.join(not_run)} need one and are not run (n/a); exit status 1", flush=True)
    runs.exit_on_sigterm()
    work = Path(tempfile.mkdtemp(prefix="titanloop_checks_"))
    try:
        if "plans" in runnable or "train" in runnable:
            row_plans(c)
        for row, fn in (("numerics", row_numerics), ("kernels", row_kernels), ("train", row_train),
                        ("preemption", row_preemption), ("eval", row_eval)):  # fmt: skip
            if row in runnable and not c.out_of_time(row):
                fn(c) if row == "numerics" else fn(c, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    c.add()  # the final json
    print(format_table(c.checks) + f"\nwrote {a.out}")
    return 1 if meta["not_run"] or any(x.ok is False for x in c.checks) or not c.checks else 0


def record_kernels_main(out: str, train_argv: list[str]) -> int:
    """`torchrun ... -m titanloop.checks --record-kernels OUT --config ...`: the trainer's own main with the kernel
    recorder installed (numerics.record_kernels); rank 0 writes the records to OUT."""
    from titanloop.train.__main__ import main as train_main  # the trainer: only in the recording process

    records: list = []
    nm.record_kernels(records)
    code = train_main(train_argv)
    if os.environ.get("RANK", "0") == "0":
        Path(out).write_text(json.dumps(records))
    return code


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    code = main()
    if sys.argv[1:2] == ["--record-kernels"]:
        from titanloop.train.process_exit import exit_without_teardown

        exit_without_teardown(code)  # as titanloop.train leaves (its native threads may abort a normal teardown)
    sys.exit(code)
