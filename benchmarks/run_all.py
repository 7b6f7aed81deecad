"""Run every titanloop benchmark (or some): each writes its result json in the benchmarks/report.py schema.

Every benchmark is also a script of its own (`python benchmarks/<script>.py --help`); each json records the exact
command that regenerates it, the commit measured and the machine. Ratios come from pairs measured in the same
run; figures that depend on machine load are min / median / max over repeats, judged on the median.

    python benchmarks/run_all.py --results             # re-measure everything at its recorded size, writing
                                                       #   benchmarks/results/*.json (hours on 2 CPUs: memory_plan
                                                       #   --direct-shapes alone is about an hour); then
    python -m benchmarks.report                        #   regenerate BENCHMARKS.md
    python benchmarks/run_all.py --results --only checkpoint loss_memory
    python benchmarks/run_all.py --tiny --out /tmp/b   # smallest sizes: checks every script runs and writes a
                                                       #   valid report json (smoke test; numbers meaningless;
                                                       #   --jobs 2 runs two at a time)

The nanoGPT comparison trains nanoGPT from your checkout of it: it runs when `--nanogpt DIR` names one (`git clone
https://github.com/karpathy/nanoGPT`) and is left out, with a line saying so, when not.

Measure committed code: a result records HEAD, and uncommitted changes under the paths it measures make it stale
from the start (benchmarks/report.py MEASURES). Each benchmark's wall time is printed as it finishes.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks.report import RESULTS, ResultError, validate  # noqa: E402

# result name (benchmarks/results/<name>.json) -> (script, arguments at the recorded size, arguments for --tiny);
# fastest first, the hour-long memory plan last
BENCHMARKS: dict[str, tuple[str, list[str], list[str]]] = {
    "scaling_on_paper": ("scaling_on_paper", [], []),
    "loss_memory": (
        "loss_memory",
        ["--repeats", "5"],
        ["--vocab", "1024", "--hidden", "64", "--seq-len", "32", "--batch", "1", "--repeats", "2"],
    ),
    "activation_checkpointing": (
        "activation_checkpointing",
        [],
        ["--loops", "1", "2", "--hidden", "64", "--vocab", "512", "--seq-len", "32", "--batch", "2", "--repeats", "2"],
    ),
    "checkpoint": ("checkpoint", [], ["--hidden", "64", "--layers", "1", "--vocab", "512", "--repeats", "2"]),
    "data_loader": (
        "data_loader",
        ["--tokens", "8000000"],
        ["--tokens", "200000", "--seq-len", "256", "--repeats", "2"],
    ),
    "data_locality": ("data_loader", ["--locality"], ["--locality", "--seq-len", "256"]),
    "document_masking": ("document_masking", ["--repeats", "30"], ["--repeats", "2", "--warmup", "0"]),
    "compile_speed": (
        "compile_speed",
        [],
        ["--hidden", "64", "--vocab", "512", "--seq-len", "32", "--batch", "2", "--repeats", "2"],
    ),
    "loop_efficiency": (
        "loop_efficiency",
        ["--repeats", "15"],
        ["--hidden", "64", "--vocab", "512", "--seq-len", "32", "--batch", "2", "--repeats", "2", "--warmup", "1"],
    ),
    "checkpoint_verify": ("checkpoint_verify", [], ["--hidden", "64", "--layers", "1", "--repeats", "2"]),
    "communication": ("communication", [], ["--steps", "2"]),
    "engine_parity": ("engine_parity", [], ["--steps", "2"]),
    "network_per_step": ("network_per_step", [], []),
    "memory_plan": ("memory_plan", ["--direct-shapes"], ["--quick", "--stages", ""]),
    "nanogpt": ("nanogpt", ["--runs", "3"], ["--runs", "1", "--steps", "20"]),
}
NEEDS_NANOGPT = {"nanogpt"}  # trained from the user's nanoGPT checkout (--nanogpt DIR)


_PRINT = threading.Lock()  # one block at a time from the benchmarks run side by side


def run_one(name: str, args: list[str], out_dir: Path, index: str, capture: bool = False) -> tuple[float, str | None]:
    """Run one benchmark writing out_dir/<name>.json; (wall seconds, error or None). With `capture` (benchmarks
    running side by side), the benchmark's output is held and printed in one block when it ends."""
    script = BENCHMARKS[name][0]
    out = out_dir / f"{name}.json"
    cmd = [sys.executable, str(HERE / f"{script}.py"), *args, "--out", str(out)]
    header = f"\n=== {index} {name}: {shlex.join(['python', f'benchmarks/{script}.py', *cmd[2:]])}"
    lines = [header] if capture else []  # held for the block, or printed now
    if not capture:
        print(header, flush=True)
    start = time.time()
    before = out.stat().st_mtime if out.is_file() else None
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    pipe = subprocess.PIPE if capture else None
    proc = subprocess.run(
        cmd, cwd=HERE.parent, env=env, text=True, stdout=pipe, stderr=subprocess.STDOUT if capture else None
    )
    wall = time.time() - start
    lines += [proc.stdout.rstrip("\n")] if capture and proc.stdout else []
    err = None
    if proc.returncode != 0 or not out.is_file() or out.stat().st_mtime == before:
        err = f"exit {proc.returncode}, {out} {'not written' if proc.returncode == 0 else 'may be partial'}"
    else:
        try:
            data = validate(out, json.loads(out.read_text()))
            if not data.get("commit"):
                err = f"{out} records no commit"
        except (ResultError, json.JSONDecodeError) as e:
            err = f"invalid report json: {e}"
    if err is None:
        lines.append(f"=== {index} {name}: {wall:.0f} s")
    if lines:
        with _PRINT:
            print("\n".join(lines), flush=True)
    return wall, err


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="benchmarks: " + ", ".join(BENCHMARKS),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--only", nargs="+", metavar="NAME", help="run only these benchmarks (result names)")
    p.add_argument("--tiny", action="store_true", help="smallest sizes (smoke test; numbers are meaningless)")
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        metavar="N",
        help="with --tiny: run N benchmarks side by side, each one's output printed when it ends (default 1; "
        "timed figures need the machine to themselves, so the recorded sizes always run one at a time)",
    )
    p.add_argument(
        "--nanogpt",
        type=Path,
        metavar="DIR",
        help="a checkout of karpathy/nanoGPT: runs the nanoGPT comparison (left out without it)",
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument("--results", action="store_true", help=f"write straight into {RESULTS}")
    where.add_argument("--out", type=Path, help="output directory (default: benchmark_results)")
    a = p.parse_args(argv)
    names = a.only or list(BENCHMARKS)
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        p.error(f"unknown benchmark(s) {unknown}: choose from {list(BENCHMARKS)}")
    if a.tiny and a.results:
        p.error("--tiny writes meaningless numbers: use --out DIR with it, not --results")
    if a.jobs < 1:
        p.error(f"--jobs must be at least 1, got {a.jobs}")
    if a.jobs > 1 and not a.tiny:
        p.error("--jobs N > 1 shares the CPUs between benchmarks and skews their timings: use it with --tiny only")
    if a.nanogpt is not None and not (a.nanogpt / "train.py").is_file():
        p.error(f"--nanogpt {a.nanogpt} holds no train.py: give a checkout of karpathy/nanoGPT")
    if a.nanogpt is None and NEEDS_NANOGPT & set(names):
        left = sorted(NEEDS_NANOGPT & set(names))
        print(f"left out {', '.join(left)}: it needs --nanogpt DIR (a checkout of karpathy/nanoGPT)", flush=True)
        names = [n for n in names if n not in NEEDS_NANOGPT]
    out_dir = RESULTS if a.results else (a.out or Path("benchmark_results"))
    out_dir.mkdir(parents=True, exist_ok=True)
    walls, failed = {}, {}

    def one(i: int, name: str) -> None:
        args = BENCHMARKS[name][2 if a.tiny else 1] + (["--nanogpt", str(a.nanogpt)] if name in NEEDS_NANOGPT else [])
        walls[name], err = run_one(name, args, out_dir, f"[{i + 1}/{len(names)}]", capture=a.jobs > 1)
        if err:
            failed[name] = err
            print(f"=== {name} FAILED after {walls[name]:.0f} s: {err}", file=sys.stderr, flush=True)

    start = time.time()
    with ThreadPoolExecutor(a.jobs) as pool:
        list(pool.map(one, range(len(names)), names))  # list(): re-raises what a thread raised
    walls = {n: walls[n] for n in names}
    print("\nwall time per benchmark:")
    for name, wall in walls.items():
        print(f"  {name:<26} {wall:>8.0f} s" + ("   FAILED" if name in failed else ""))
    print(
        f"  {'total':<26} {sum(walls.values()):>8.0f} s"
        + (f" ({time.time() - start:.0f} s wall, {a.jobs} at once)" if a.jobs > 1 else "")
    )
    if failed:
        for name, err in failed.items():
            script = BENCHMARKS[name][0]
            print(
                f"error: benchmark {name} failed ({err}); rerun it alone: python benchmarks/{script}.py --help",
                file=sys.stderr,
            )
        return 1
    print(f"wrote {len(names)} result(s) to {out_dir}")
    if a.results:
        print("next: python -m benchmarks.report   (regenerates BENCHMARKS.md from them)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
