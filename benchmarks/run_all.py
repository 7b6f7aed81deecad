"""Run every titanloop benchmark (or some), print each table, and write one combined JSON.

Every benchmark is also a script of its own (`python benchmarks/<name>.py --help`). Each ratio is computed
from pairs measured in the same run on this machine; absolute times are noise on shared CPUs.

    python benchmarks/run_all.py                       # all rows, default sizes (tens of minutes on 2 CPUs)
    python benchmarks/run_all.py --only loss_memory loop_efficiency
    python benchmarks/run_all.py --tiny --out /tmp/b   # smallest sizes: checks the commands run (smoke test)

Results: <out>/<name>.json per benchmark and <out>/all.json. The figures quoted in BENCHMARKS.md live in
benchmarks/results/<name>.json (schema: benchmarks/report.py); BENCHMARKS.md is generated from them with
`python -m benchmarks.report`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

# name -> (arguments at default size, arguments for --tiny)
BENCHMARKS: dict[str, tuple[list[str], list[str]]] = {
    "loop_efficiency": (
        [],
        ["--hidden", "64", "--vocab", "512", "--seq-len", "32", "--batch", "2", "--repeats", "1", "--warmup", "1"],
    ),
    "loss_memory": ([], ["--vocab", "1024", "--hidden", "64", "--seq-len", "32", "--batch", "1"]),
    "activation_checkpointing": (
        [],
        ["--loops", "1", "2", "--hidden", "64", "--vocab", "512", "--seq-len", "32", "--batch", "2", "--repeats", "1"],
    ),
    "communication": ([], ["--steps", "2"]),
    "data_loader": ([], ["--tokens", "200000", "--seq-len", "256"]),
    "checkpoint": ([], ["--hidden", "64", "--layers", "1", "--vocab", "512", "--repeats", "1"]),
    "scaling_on_paper": ([], []),
    "document_masking": ([], ["--repeats", "1", "--warmup", "0"]),
}


def run_one(name: str, args: list[str], out_dir: Path) -> dict:
    out = out_dir / f"{name}.json"
    cmd = [sys.executable, str(HERE / f"{name}.py"), *args, "--out", str(out)]
    print(f"\n=== {name}: {' '.join(cmd[1:])}", flush=True)
    start = time.time()
    proc = subprocess.run(
        cmd, cwd=HERE.parent, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}, text=True
    )
    if proc.returncode != 0 or not out.is_file():
        raise SystemExit(
            f"error: benchmark {name} failed (exit {proc.returncode}); rerun it alone: "
            f"python benchmarks/{name}.py --help"
        )
    print(f"=== {name}: {time.time() - start:.0f} s", flush=True)
    return json.loads(out.read_text())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="benchmarks: " + ", ".join(BENCHMARKS))
    p.add_argument("--only", nargs="+", metavar="NAME", help="run only these benchmarks")
    p.add_argument("--tiny", action="store_true", help="smallest sizes (smoke test; numbers are meaningless)")
    p.add_argument("--out", type=Path, default=Path("benchmark_results"), help="output directory")
    a = p.parse_args(argv)
    names = a.only or list(BENCHMARKS)
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        p.error(f"unknown benchmark(s) {unknown}: choose from {list(BENCHMARKS)}")
    a.out.mkdir(parents=True, exist_ok=True)
    results = {n: run_one(n, BENCHMARKS[n][1 if a.tiny else 0], a.out) for n in names}
    (a.out / "all.json").write_text(json.dumps({"tiny": a.tiny, "results": results}, indent=2))
    print(f"\nwrote {a.out / 'all.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
