"""`python scripts/plan_vs_gpu.py`: the memory plan of every titanloop training run a GPU session measured, against
the peak it measured (issue 34: the plan within 15% on the GPU).

The runs and their peaks (`torch.cuda.max_memory_allocated`) come from the committed results of one GPU session,
benchmarks/results/gpu_check.json (its training and memory runs) and gpu_throughput.json (its matrix and
comparison runs); each run's training arguments are rebuilt here by the same code that launched it
(scripts/gpu_check.py's RunSpec.args, benchmarks/gpu_throughput.py's titanloop_args), and planned by this checkout's
`titanloop.train.memory_plan` on the dry run's fake backend (no GPU; about a minute per run on 2 cores). Writes a
json (default benchmarks/results/gpu_sessions/<date>/plan_vs_gpu.json) with the command, the commit planned, the
results' commit and device, and one row per run: planned GiB, measured GiB, measured / planned - 1, the plan's notes.
A plan is only as comparable as the code: the json records both commits.

    python scripts/plan_vs_gpu.py                       # the committed gpu_check.json + gpu_throughput.json
    python scripts/plan_vs_gpu.py --only "T=4 2 seq"    # runs whose label contains the text
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"
GIB = 2**30
TOL = 0.15  # issue 34's band


def _gpu_check():
    """scripts/gpu_check.py as the throughput benchmark loads it (one module for both kinds of runs)."""
    from benchmarks import gpu_throughput as gt

    return gt.gpu_check


def check_runs(doc: dict) -> list[tuple[str, list[str], int, float]]:
    """(label, training args, GPUs, measured GiB) of gpu_check.json's runs that recorded a peak."""
    gc = _gpu_check()
    res = doc["result"]
    steps = res.get("steps") or 40
    loops = sorted({run["n_loops"] for run in res["runs"]}) or [4]  # the T a subset ran (e.g. --loops 8)
    a = gc.parse_args(["--steps", str(steps), "--loops", ",".join(map(str, loops))])
    a.name, a.overrides, a.n_gpus, a.shape_text = res.get("shape", "ouro-1.4b"), {}, res.get("n_gpus", 1), ""
    a.seq_len = res.get("seq_len", a.seq_len)
    specs = {(s.n_loops, s.precision, s.ac, s.compiled): s for s in gc.training_runs(a)}
    out = []
    for run in res["runs"]:
        spec = specs.get((run["n_loops"], run["precision"], run["ac"], run["compiled"]))
        if spec is None or not run.get("peak_gib"):
            continue
        label = f"gpu_check T={run['n_loops']} {run['precision']} AC {run['ac']}{'' if run['compiled'] else ' eager'}"
        out.append((label, spec.args(a, Path("/tmp/plan_vs_gpu")), a.n_gpus, run["peak_gib"]))
    return out


def throughput_runs(doc: dict) -> list[tuple[str, list[str], int, float]]:
    """(label, training args, GPUs, measured GiB) of gpu_throughput.json's titanloop runs that recorded a peak."""
    from benchmarks import gpu_throughput as gt

    ctx = gt.gpu_context()
    jobs = gt.build_plan(ctx, gt.DEFAULT_MATRIX, profile=True, dense=True, always_titanloop_dense=True)
    by_label = {gt._compare_label(j) if j.role != "matrix" else j.setting.label: j for j in jobs}
    out = []
    for run in doc["result"]["runs"]:
        # the job as the run recorded it; by its label in today's default matrix only where it recorded none
        job = gt.job_from_record(run["job"]) if run.get("job") else by_label.get(run["label"])
        # torchtitan's runs are not titanloop's to plan; a further launch of the comparison is the same run again
        if job is None or job.role == "dense" or job.launch > 1 or not run.get("peak_gib"):
            continue
        base, setting = gt.titanloop_args(ctx, job, Path("/tmp/plan_vs_gpu"))
        out.append((f"gpu_throughput {run['label']}", base + setting, ctx.n_gpus, run["peak_gib"]))
    return out


def plan(args: list[str], n_gpus: int) -> tuple[float, list[str]]:
    """(peak GiB, notes) of the plan gpu_check makes for a training run with these arguments."""
    gc = _gpu_check()
    p = gc.memory_plan_of(gc.TRAIN_CONFIG, args, n_gpus)
    return p.peak / GIB, list(p.notes)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python scripts/plan_vs_gpu.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--check-json", default=str(RESULTS / "gpu_check.json"), help="gpu_check's result")
    ap.add_argument("--throughput-json", default=str(RESULTS / "gpu_throughput.json"), help="gpu_throughput's")
    ap.add_argument("--only", default="", help="plan only the runs whose label contains this text")
    ap.add_argument("--out", default=None, help="the json to write (default: the results' session folder)")
    a = ap.parse_args(argv)
    docs = {}
    for name, path in (("check", a.check_json), ("throughput", a.throughput_json)):
        if not Path(path).is_file():
            ap.exit(2, f"error: {path} does not exist: give --{name}-json a GPU result json\n")
        docs[name] = json.loads(Path(path).read_text())
    runs = [r for r in check_runs(docs["check"]) + throughput_runs(docs["throughput"]) if a.only in r[0]]
    if not runs:
        ap.exit(2, f"error: no measured run matches --only {a.only!r}\n")
    rows = []
    for i, (label, args, n_gpus, measured) in enumerate(runs, 1):
        t0 = time.perf_counter()
        planned, notes = plan(args, n_gpus)
        rel = measured / planned - 1
        rows.append({"run": label, "planned_gib": planned, "measured_gib": measured, "rel": rel, "notes": notes})
        print(
            f"[{i}/{len(runs)}] {label}: planned {planned:.2f} GiB, measured {measured:.2f} GiB ({100 * rel:+.1f}%, "
            f"{'within' if abs(rel) <= TOL else 'OUTSIDE'} {100 * TOL:.0f}%) ({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    code = ["titanloop", "train_configs", "scripts", ":(glob)benchmarks/*.py"]  # what plans; not result jsons
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no", "--", *code], cwd=ROOT, capture_output=True
    )
    measured_at = docs["check"].get("commit") or docs["check"]["result"].get("commit")
    doc = {
        "command": "python " + " ".join(["scripts/plan_vs_gpu.py", *(argv if argv is not None else sys.argv[1:])]),
        "planned_at": head + (" (with uncommitted code changes)" if dirty.stdout.strip() else ""),
        "measured_at": measured_at,
        "measured_on": docs["check"].get("machine"),
        "date": datetime.date.today().isoformat(),
        "tolerance": TOL,
        "within": sum(abs(r["rel"]) <= TOL for r in rows),
        "rows": rows,
    }
    out = Path(a.out) if a.out else RESULTS / "gpu_sessions" / docs["check"]["date"] / "plan_vs_gpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{doc['within']} of {len(rows)} within {100 * TOL:.0f}%; wrote {out}")
    return 0 if doc["within"] == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
