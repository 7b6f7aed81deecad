"""Trainer runs for the GPU checks and the GPU benchmarks: the overrides of a measured training run, launching it
with its workers in a process group of their own (stopped together at a time limit or on the way out), and reading
back what its metrics.jsonl says (tokens/s, the trainer's MFU, peak memory, loss)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import signal
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRAIN_CONFIG = ROOT / "train_configs" / "debug.toml"
MOTIF_VOCAB = 64  # synthetic text whose motifs use 63 ids of the 49K vocabulary: learned within a short run
PRECISIONS = ("bf16", "tensorwise", "rowwise")
STOP_GRACE_S = 30.0  # SIGTERM to a run's process group, then SIGKILL (torchrun forwards SIGTERM to its workers)


def train_args(
    run_dir: Path,
    preset: str,
    model: dict,
    n_loops: int,
    seq_len: int,
    n_gpus: int,
    precision: str = "bf16",
    steps: int = 60,
    micro_batch: int = 1,
    ac: str = "loop",
) -> list[str]:
    """Overrides of TRAIN_CONFIG for a measured run: synthetic text at the Ouro vocabulary with motifs from
    MOTIF_VOCAB ids, AdamW at 1e-3 after 10 warmup steps, compile, activation checkpointing `ac`, every
    `model` override; `precision` bf16 adds nothing (training.dtype auto is bf16 on a GPU), a float8 recipe sets
    `--float8.recipe`."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: expected one of {PRECISIONS}")
    args = {
        "model.vocab_size": 49152,
        "data.motif_vocab": MOTIF_VOCAB,
        "training.run_dir": run_dir,
        "training.steps": steps,
        "training.seq_len": seq_len,
        "training.micro_batch_size": micro_batch,
        "training.global_batch_size": micro_batch * n_gpus,
        "model.preset": preset,
        "loop_sampler.n_loops": n_loops,
        "optimizer.lr": 1e-3,
        "lr_scheduler.warmup_steps": 10,
        "parallelism.compile": "true",
        "parallelism.activation_checkpoint": ac,
        "metrics.log_freq": 5,
        "metrics.wandb": "off",
        "checkpoint.enable": "false",
        **{f"model.{k}": v for k, v in model.items()},
    }
    if precision != "bf16":
        args["float8.recipe"] = precision
    return [item for key, value in args.items() for item in (f"--{key}", str(value))]


def missing_modules(precision: str = "bf16") -> list[str]:
    """What a training run needs that this interpreter cannot import (torchtitan; torchao for float8)."""
    needed = ["torchtitan"] + (["torchao"] if precision != "bf16" else [])
    return [m for m in needed if importlib.util.find_spec(m) is None]


def environment() -> dict:
    """A run's environment: this checkout's titanloop first on PYTHONPATH, one OpenMP thread, W&B offline."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1"}  # fmt: skip


def stop_group(proc: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM to `proc`'s process group (started with start_new_session), SIGKILL to what is left after `grace_s`."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def start(cmd: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    """`cmd` in its own process group (torchrun and its workers together), its output appended to `log` (a file:
    a pipe nobody reads blocks the run when it fills)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as f:
        return subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env or environment(), start_new_session=True
        )


def wait(proc: subprocess.Popen, timeout: float | None) -> int | None:
    """`proc`'s exit code, or None when it still ran after `timeout` s and its group was stopped. Whatever stops
    the wait (Ctrl-C, SIGTERM through exit_on_sigterm) stops the group too."""
    try:
        return proc.wait(timeout=None if timeout is None else max(timeout, 1.0))
    except subprocess.TimeoutExpired:
        stop_group(proc)
        return None
    except BaseException:
        stop_group(proc, 10.0)
        raise


def run(cmd: list[str], log: Path, timeout: float | None, env: dict | None = None) -> int | None:
    """start() then wait()."""
    return wait(start(cmd, log, env), timeout)


def exit_on_sigterm() -> None:
    """SIGTERM (a job scheduler stopping the command) raises SystemExit, so that the run waited on is stopped too;
    by default Python would exit at once and leave that run's process group holding the GPUs."""

    def handler(signum, frame):  # noqa: ARG001 - signal's signature
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        sys.exit(128 + signal.SIGTERM)

    signal.signal(signal.SIGTERM, handler)


def metrics(run_dir: Path) -> list[dict]:
    """The rows of a run's metrics.jsonl (none when it logged nothing)."""
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def median_throughput(rows: list[dict], warmup: int, exclude=frozenset(), n_gpus: int = 1) -> dict:
    """Medians over a run's metrics rows after step `warmup` (and not in `exclude`): tokens/s/GPU, the trainer's
    own MFU (titanloop.train.mfu; None when a row has none: an unknown device, the CPU), TFLOP/s; the largest
    logged peak memory (max_mem_gib; None on the CPU)."""
    used = [r for r in rows if r["step"] > warmup and r["step"] not in exclude and "tokens_per_s" in r]
    if not used:
        raise ValueError(f"no logged step after the warm-up ({warmup} steps) to measure ({len(rows)} rows logged)")
    mfus = [r.get("mfu") for r in used]
    peaks = [r["max_mem_gib"] for r in rows if r.get("max_mem_gib") is not None]
    return {
        "tokens_per_s_gpu": statistics.median(r["tokens_per_s"] for r in used) / n_gpus,
        "mfu": None if None in mfus else statistics.median(mfus),
        "tflops": statistics.median(r["tflops"] for r in used),
        "peak_gib": max(peaks) if peaks else None,
        "steps_measured": len(used),
    }


_ERROR_LINE = re.compile(r"^(error: |[\w.]*(Error|Exception)\b)")


def failure(code: int | None, log: Path, chars: int = 300) -> str:
    """Why a run failed, in one line: stopped at the time limit, or its exit code and its log's last error line
    (`error: ...` from the trainer's checks, an exception's `XError: ...` but not torchrun's ChildFailedError),
    else its last 3 lines."""
    if code is None:
        return f"stopped at the time limit (--time-limit); log: {log.name}"
    text = log.read_text(errors="replace") if log.is_file() else ""
    lines = [re.sub(r"^\[rank\d+\]:\s*", "", line.strip()) for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if _ERROR_LINE.match(line) and "ChildFailedError" not in line]
    return f"exit {code}: " + (errors[-1] if errors else " | ".join(lines[-3:]))[:chars]


def git_commit() -> str:
    """HEAD of this checkout, with '+dirty' when tracked files differ from it; 'unknown' outside a git checkout."""
    try:
        git = ["git", "-C", str(ROOT)]
        head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
        return head + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def record_path(what: str, device: str) -> Path:
    """benchmarks/results/<date>-<device>-<what>.json, the dated record a GPU run writes by default (device: the
    first model number of its name, e.g. h100 for "NVIDIA H100 80GB HBM3"; cpu without one), with -2, -3, ...
    appended when that record exists: a new run never overwrites a record."""
    import datetime

    model = re.search(r"\b([A-Z]+\d+[A-Z]*)\b", device.upper())
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    return fresh_path(ROOT / "benchmarks" / "results" / f"{date}-{model[1].lower() if model else 'cpu'}-{what}.json")


def fresh_path(path: Path) -> Path:
    """`path`, or with -2, -3, ... appended to its stem when that file exists: a record is never overwritten."""
    path, n, stem = Path(path), 1, Path(path).stem
    while path.exists():
        n += 1
        path = path.with_name(f"{stem}-{n}{path.suffix}")
    return path


def benchmark_parser(prog: str, doc: str, what: str):
    """The command line every GPU benchmark shares: its help from its docstring (first paragraph, then the rest),
    --smoke and --out (default: the dated record `what`, record_path; with --smoke a file in the temp directory)."""
    import argparse

    p = argparse.ArgumentParser(
        prog=prog,
        description=doc.split("\n\n")[0],
        epilog=doc.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--smoke", action="store_true", help="the CPU at tiny sizes (numbers meaningless)")
    p.add_argument("--out", type=Path, default=None, help=f"result json (default: benchmarks/results/<date>-"
                   f"<device>-{what}.json; --smoke: in the temporary directory)")  # fmt: skip
    p.set_defaults(record=what)
    return p


def out_path(a, machine: str) -> Path:
    """Where a benchmark parsed by benchmark_parser writes its json on `machine` (its --out, else the default)."""
    import tempfile

    if a.out is not None:
        return fresh_path(a.out)  # a run never overwrites an earlier json
    return Path(tempfile.gettempdir()) / f"{a.record}-smoke.json" if a.smoke else record_path(a.record, machine)
