#!/usr/bin/env python3
"""`python3 scripts/gpu_session.py`: one GPU call that runs the GPU checks of issues 34, 35 and 36 within one time
budget and leaves every result, finished or not, in one folder (the device tool's $OUT).

    # here, on the CPU, beforehand (minutes: on 2 cores a 1.4B plan at T = 8 takes 202 s in bf16, 377 s in rowwise):
    # the memory plans of the check part's runs
    python scripts/gpu_session.py --write-plans plans.json
    # there: a session lent a GPU for 15 minutes (starts included) has room for two calls, e.g.
    python3 scripts/gpu_session.py --out "$OUT" --commit <HEAD>                        # 540 s: check, throughput
    python3 scripts/gpu_session.py --out "$OUT" --commit <HEAD> --parts eval --budget-s 240      # the next call

Parts, run one after the other in the order --parts gives (default check:340,throughput); `name:S` gives a part at
most S seconds, a part without S gets an equal share of what is left of --budget-s when it starts:
  check       scripts/gpu_check.py (issue 34): single-GPU checks, kernel choice, training runs with their memory
              plans (--plan-json plans.json when it exists), the memory runs without AC; --check-args (default
              "--steps 40": 333 s by `python scripts/gpu_check.py --estimate --steps 40`) adds options
  eval        scripts/gpu_eval_check.py (issue 36): validation == eval CLI, KV-cache generation, the 1.4B sweep
              (about 5 minutes by a rough estimate; its rows run in order until its budget is spent)
  throughput  benchmarks/gpu_throughput.py (issue 35): in priority order the shipped setting in bf16 (profiled),
              looped vs dense, its float8 twins (profiled), looped vs dense again, the shipped setting accumulating,
              then other AC policies and T = 8 as time allows (`--plan` gives its estimates)
--throughput-args and --eval-args add options to those parts as --check-args does to the check.
Each part gets its budget as its own --budget-s (its rows that no longer fit are skipped, its runs stopped), and is
stopped 60 s past it if it has not ended. Each rewrites its json as it goes, so a part cut short still reports.

Before the parts, the wheels in .whl/ are installed into /tmp/site (shared/GPU.md) when torchtitan or torchao does
not import. --out receives at most 5 files: gpu_check.json, gpu_eval.json, gpu_throughput.json, session.json (each
part's command, budget, exit code and seconds) and logs.tar.gz (each part's output, every run's log and metrics, the
gzipped traces; checkpoints left out; kept under 15 MiB, as the device tool brings back no file over 16 MiB, by
leaving out the files that compress largest, which session.json then names). `--smoke` runs the parts at their
CPU smoke sizes (no GPU needed).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu_procs beside it, also when loaded from a file

from gpu_procs import wait_or_stop  # noqa: E402

PARTS = {
    "check": ("scripts/gpu_check.py", "gpu_check.json"),
    "eval": ("scripts/gpu_eval_check.py", "gpu_eval.json"),
    "throughput": ("benchmarks/gpu_throughput.py", "gpu_throughput.json"),
}
DEFAULT_PARTS = "check:340,throughput"
DEFAULT_CHECK_ARGS = "--steps 40"
DEFAULT_BUDGET_S = 540.0  # a 600-s call, less the machine's copy, the wheels and a margin
RESERVE_S = 15.0  # kept back from the budget for the tarball and session.json
OVERRUN_S = 60.0  # a part is stopped this long after its own budget
SITE = Path("/tmp/site")
LOG_SUFFIXES = (".log", ".jsonl", ".json", ".gz", ".txt")
MAX_LOG_BYTES = 20 * 2**20  # a file larger than this stays out of logs.tar.gz
# The device tool brings back files of at most 16 MiB: a larger logs.tar.gz would not come back at all (three
# profiled throughput rows keep ~3-5 MiB of gzipped trace each, beside the profiler's raw traces in the run dirs)
TARBALL_CAP = 15 * 2**20


def parse_parts(text: str) -> list[tuple[str, float | None]]:
    """'check:240,eval' -> [('check', 240.0), ('eval', None)]; ValueError with what is wrong."""
    parts = []
    for item in text.split(","):
        name, _, seconds = item.strip().partition(":")
        if name not in PARTS:
            raise ValueError(f"unknown part {name!r}: expected some of {', '.join(PARTS)}, e.g. check:240,eval")
        if any(n == name for n, _ in parts):
            raise ValueError(f"part {name!r} is given twice")
        try:
            value = float(seconds) if seconds else None
        except ValueError:
            raise ValueError(f"part {item!r}: the seconds after ':' must be a number, e.g. {name}:240") from None
        if value is not None and value <= 0:
            raise ValueError(f"part {item!r}: the seconds after ':' must be > 0")
        parts.append((name, value))
    return parts


def part_budget(given: float | None, left: float, parts_left: int) -> float:
    """A part's budget: what it was given, or an equal share of what is left, never more than is left."""
    share = left / max(parts_left, 1)
    return max(0.0, min(left, given if given is not None else share))


def git_head() -> str | None:
    try:
        proc = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def install_wheels(python: str) -> str:
    """Install .whl/*.whl into /tmp/site when torchtitan or torchao does not import; one line on what was done."""
    if SITE.is_dir() and str(SITE) not in sys.path:
        sys.path.insert(0, str(SITE))  # installed by an earlier call on this machine
    missing = [m for m in ("torchtitan", "torchao") if importlib.util.find_spec(m) is None]
    wheels = sorted((ROOT / ".whl").glob("*.whl"))
    if not missing:
        return "wheels: not needed (torchtitan and torchao import)"
    if not wheels:
        return f"wheels: {missing} missing and no .whl/*.whl here (shared/GPU.md says how to bring them)"
    cmd = [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir"]
    cmd += ["--upgrade", "--target", str(SITE), *map(str, wheels)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return f"wheels: pip failed (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}"
    return f"wheels: {len(wheels)} installed into {SITE}"


def part_command(name: str, a: argparse.Namespace, budget: float, work: Path) -> list[str]:
    script, json_name = PARTS[name]
    cmd = [a.python, str(ROOT / script), "--out", str(a.out / json_name), "--budget-s", f"{budget:.0f}"]
    if a.commit:
        cmd += ["--commit", a.commit]
    if a.smoke:
        cmd.append("--smoke")
    if name == "check":
        cmd += ["--workdir", str(work / "check"), *check_args(a)]
        if a.plan_json.is_file() and not a.smoke:
            cmd += ["--plan-json", str(a.plan_json)]
    elif name == "eval":
        cmd += ["--workdir", str(work / "eval"), *shlex.split(a.eval_args)]
    else:
        cmd += ["--artifacts", str(work / "throughput"), *shlex.split(a.throughput_args)]
    return cmd


def check_args(a: argparse.Namespace) -> list[str]:
    """--check-args as a list; by default DEFAULT_CHECK_ARGS, and nothing with --smoke (its own tiny sizes)."""
    if a.check_args is None:
        return [] if a.smoke else shlex.split(DEFAULT_CHECK_ARGS)
    return shlex.split(a.check_args)


def run_part(cmd: list[str], log: Path, timeout: float, env: dict) -> int | None:
    """The part's exit code, or None when it was stopped at `timeout`: SIGTERM to its process group, on which the
    part stops the run it is waiting on (gpu_procs), then SIGKILL 30 s later. Its output is echoed as it comes (the
    call's output) and kept in `log`."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True)

        def copy() -> None:
            assert proc.stdout is not None
            for line in iter(proc.stdout.readline, b""):
                text = line.decode(errors="replace")
                sys.stdout.write(text)
                sys.stdout.flush()
                f.write(text)

        reader = threading.Thread(target=copy, daemon=True)
        reader.start()
        code = wait_or_stop(proc, timeout)  # SIGTERM first: the part then stops the run it is waiting on
        reader.join(timeout=10)
        return code


def _gzipped_size(path: Path) -> int:
    """Bytes `path` takes gzipped (as tarfile's "w:gz" compresses it, to within the tar headers)."""
    import zlib

    packer, size = zlib.compressobj(6, zlib.DEFLATED, 31), 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            size += len(packer.compress(chunk))
    return size + len(packer.flush())


def pack_logs(work: Path, tarball: Path, cap: int = TARBALL_CAP) -> tuple[int, list[str]]:
    """Every small log, metrics, json and trace file under `work` into `tarball`, kept under `cap` bytes by leaving
    out the files that compress largest (the profiler's raw traces first); (how many went in, those left out)."""
    files = [p for p in sorted(work.rglob("*")) if p.is_file() and p.suffix in LOG_SUFFIXES]
    files = [p for p in files if p.stat().st_size <= MAX_LOG_BYTES]
    size = {p: _gzipped_size(p) + 1024 for p in files}  # + a tar header and padding each
    kept, total = set(), 1024
    for p in sorted(files, key=size.get):
        if total + size[p] <= cap:
            kept.add(p)
            total += size[p]
    with tarfile.open(tarball, "w:gz") as tar:
        for p in files:
            if p in kept:
                tar.add(p, arcname=str(p.relative_to(work)))
    return len(kept), [f"{p.relative_to(work)} ({size[p] / 2**20:.1f} MiB gzipped)" for p in files if p not in kept]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python3 scripts/gpu_session.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", type=Path, help='the folder for the results (on the GPU machine: "$OUT")')
    p.add_argument("--commit", help="the commit measured (40 hex digits; default: git HEAD, which a copy lacks)")
    p.add_argument("--parts", default=DEFAULT_PARTS, help=f"parts and their seconds (default {DEFAULT_PARTS})")
    p.add_argument(
        "--budget-s", type=float, default=DEFAULT_BUDGET_S, help="seconds for all parts (default %(default)s)"
    )
    p.add_argument(
        "--check-args",
        default=None,
        help='more options for scripts/gpu_check.py, as one string after "=", e.g. --check-args="--learning '
        f'--steps 40" (give the same to --write-plans; default "{DEFAULT_CHECK_ARGS}", none with --smoke)',
    )
    p.add_argument(
        "--throughput-args",
        default="",
        help='more options for benchmarks/gpu_throughput.py, e.g. --throughput-args="--setting 2:loop:tensorwise '
        '--no-dense"',
    )
    p.add_argument(
        "--eval-args",
        default="",
        help='more options for scripts/gpu_eval_check.py, e.g. --eval-args="--rows head_stats_syncs" (some rows only)',
    )
    p.add_argument("--plan-json", type=Path, default=ROOT / "plans.json", help="the plans (default %(default)s)")
    p.add_argument(
        "--write-plans",
        type=Path,
        metavar="FILE",
        help="no GPU: write the check part's memory plans to FILE (then pass it to the GPU call) and exit",
    )
    p.add_argument("--smoke", action="store_true", help="every part at its CPU smoke size (no GPU needed)")
    p.add_argument("--python", default=sys.executable, help="the interpreter of the parts (default: this one)")
    a = p.parse_args(argv)
    try:
        a.parts = parse_parts(a.parts)
    except ValueError as e:
        p.error(f"--parts: {e}")
    if a.budget_s <= 0:
        p.error(f"--budget-s {a.budget_s:g}: expected seconds > 0")
    if a.commit is not None and not re.fullmatch(r"[0-9a-f]{40}", a.commit):
        p.error(f"--commit {a.commit!r}: expected a full 40-digit hash (git rev-parse HEAD)")
    if a.out is None and not a.write_plans:
        p.error('--out is required: the folder for the results (on the GPU machine: --out "$OUT")')
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.write_plans:
        cmd = [a.python, str(ROOT / PARTS["check"][0]), "--write-plans", str(a.write_plans), *check_args(a)]
        return subprocess.run(cmd).returncode
    start = time.monotonic()
    a.commit = a.commit or git_head()
    if a.commit is None:
        print("gpu_session: warning: no --commit and no git here: the jsons will say the commit is unknown")
    a.out.mkdir(parents=True, exist_ok=True)
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"gpu_session_{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    print(install_wheels(a.python), flush=True)
    path = os.pathsep.join(
        p for p in (str(SITE) if SITE.is_dir() else "", str(ROOT), os.environ.get("PYTHONPATH")) if p
    )
    env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "offline"}
    session = {"commit": a.commit, "budget_s": a.budget_s, "parts": []}
    for i, (name, given) in enumerate(a.parts):
        left = a.budget_s - RESERVE_S - (time.monotonic() - start)
        budget = part_budget(given, left, len(a.parts) - i)
        record = {"part": name, "budget_s": round(budget)}
        if budget < 30:
            record.update(exit=None, skipped=f"{left:.0f} s of --budget-s left")
            print(f"gpu_session: {name} skipped ({left:.0f} s of the budget left)", flush=True)
        else:
            cmd = part_command(name, a, budget, work)
            print(f"gpu_session: {name}, {budget:.0f} s: {shlex.join(cmd)}", flush=True)
            t0 = time.monotonic()
            code = run_part(cmd, work / f"{name}.log", budget + OVERRUN_S, env)
            record.update(command=shlex.join(cmd), exit=code, seconds=round(time.monotonic() - t0, 1))
            print(f"gpu_session: {name} ended: exit {code} after {record['seconds']} s", flush=True)
        session["parts"].append(record)
        (a.out / "session.json").write_text(json.dumps(session, indent=2) + "\n")
    n, left_out = pack_logs(work, a.out / "logs.tar.gz")
    shutil.rmtree(work, ignore_errors=True)  # (the eval part's checkpoints are GBs)
    if left_out:
        session["logs_left_out"] = left_out
        print(f"gpu_session: left out of logs.tar.gz to keep it under {TARBALL_CAP >> 20} MiB: {', '.join(left_out)}")
    session["seconds"] = round(time.monotonic() - start, 1)
    (a.out / "session.json").write_text(json.dumps(session, indent=2) + "\n")
    print(f"gpu_session: {session['seconds']} s; {n} log files in {a.out / 'logs.tar.gz'}; results in {a.out}")
    return 0 if all(p.get("exit") == 0 for p in session["parts"]) else 1


if __name__ == "__main__":
    sys.exit(main())
