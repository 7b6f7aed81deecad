"""CPU probe: which of the loop-separating model settings lets the later loops of the learning task beat loop 1?

The GPU check's learning run (ouro-1.4b, Ouro's default model settings) ended with loops 2-4 at a fixed point above
loop 1 on an H100 (benchmarks/results/gpu/2026-11-27-h100-check-learning-dense.json). The same task at debug-small on
CPU shows the same pattern, and the README demo's four separating settings together remove it
(loop_separation_ouro_defaults.json beside this file). This probe runs
each variant below through `torchrun -m titanloop.train` (one process, the learning row's task at debug-small) and
records the per-loop CE by quarter of the run, the hidden RMS and p(t) at the end.

    python benchmarks/probes/loop_separation.py --out benchmarks/probes/loop_separation.json \
        --variants defaults,readout_raw,no_inter_loop_norm --seeds 2,3 [--steps 300] [--jobs 2]

Each run takes a few minutes on one core; --jobs runs that many at once (at most the cores you have).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # this checkout's benchmarks package, when run as a script

from benchmarks.report import measured_commit  # noqa: E402
from titanloop.train.launch import torchrun  # noqa: E402

# the learning row's task (motifs from 64 ids) at debug-small, as in the session-3 CPU probe
BASE = [
    "--model.preset", "debug-small", "--model.vocab_size", "4096", "--data.motif_vocab", "64",
    "--training.seq_len", "1024", "--training.micro_batch_size", "2", "--training.global_batch_size", "2",
    "--loop_sampler.n_loops", "4", "--optimizer.lr", "1e-3", "--lr_scheduler.warmup_steps", "30",
    "--lr_scheduler.decay_ratio", "0.0", "--parallelism.compile", "false", "--parallelism.activation_checkpoint",
    "loop", "--objective.name", "dense", "--metrics.log_freq", "1", "--metrics.wandb", "off",
    "--checkpoint.enable", "false",
]  # fmt: skip

TORCHRUN = torchrun(1, "-m", "titanloop.train", "--config", "train_configs/debug.toml")[1:]  # (without the python)

SEPARATING = {
    "readout_raw": ["--model.readout", "raw"],
    "no_inter_loop_norm": ["--model.inter_loop_norm", "false"],
    "embed_std_1": ["--model.embed_init_std", "1.0"],
    "inject_embedding": ["--model.inject_embedding", "true"],
}
VARIANTS = {
    "defaults": [],
    **SEPARATING,
    "all_four": [a for v in SEPARATING.values() for a in v],
    "all_but_inject": [a for k, v in SEPARATING.items() if k != "inject_embedding" for a in v],
    "raw_no_norm": SEPARATING["readout_raw"] + SEPARATING["no_inter_loop_norm"],
    "no_norm_and_inject": SEPARATING["no_inter_loop_norm"] + SEPARATING["inject_embedding"],
    "inject_and_embed_std_1": SEPARATING["inject_embedding"] + SEPARATING["embed_std_1"],
}


def quarters(rows: list[dict], key: str) -> list[list[float]]:
    """Mean of rows[i][key][t] over each quarter of the run, as [quarter][loop]."""
    n = len(rows)
    out = []
    for q in range(4):
        part = rows[q * n // 4 : (q + 1) * n // 4]
        loops = len(part[0][key])
        out.append([round(sum(r[key][t] for r in part) / len(part), 3) for t in range(loops)])
    return out


def run(variant: str, seed: int, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        args = [*BASE, "--training.steps", str(steps), "--training.seed", str(seed), "--data.seed", str(seed)]
        args += ["--training.run_dir", str(run_dir), *VARIANTS[variant]]
        cmd = [sys.executable, *TORCHRUN, *args]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        t0 = time.time()
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{variant} seed {seed} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        print(f"  {variant} seed {seed}: {time.time() - t0:.0f} s", flush=True)
        return {**summarize(variant, seed, run_dir / "metrics.jsonl"), "wall_s": round(time.time() - t0, 1)}


def summarize(variant: str, seed: int, metrics: Path) -> dict:
    """One run's record from its metrics.jsonl (every step logged)."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    rows = [r for r in rows if "ce" in r]
    return {
        "variant": variant,
        "seed": seed,
        "args": VARIANTS[variant],
        "steps_logged": len(rows),
        "ce_per_loop_by_quarter": quarters(rows, "ce"),
        "hidden_rms_end": [round(v, 2) for v in rows[-1]["hidden_rms"]],
        "exit_prob_end": [round(v, 3) for v in rows[-1]["exit_prob"]],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="json to write (replaced)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    p.add_argument("--seeds", default="2,3", help="comma list of seeds (training.seed and data.seed)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--jobs", type=int, default=1, help="runs at once (one core each)")
    p.add_argument("--merge", nargs="*", default=[], help="earlier outputs of this probe whose runs to keep")
    p.add_argument(
        "--from-metrics",
        nargs="*",
        default=[],
        metavar="VARIANT:SEED:PATH",
        help="record a finished run of this probe from its metrics.jsonl (e.g. a probe stopped before it wrote)",
    )
    p.add_argument("--note", action="append", default=[], help="a note for the json (repeatable)")
    a = p.parse_args()
    variants = [v for v in a.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variant(s) {unknown}; choose from {', '.join(VARIANTS)}")
    seeds = [int(s) for s in a.seeds.split(",") if s]
    todo = [(v, s) for v in variants for s in seeds]
    print(f"{len(todo)} runs of {a.steps} steps, {a.jobs} at once", flush=True)
    commit = measured_commit("loop_separation")  # HEAD, with a warning when the checkout has uncommitted changes
    runs: list[dict] = []
    for path in a.merge:
        if not Path(path).is_file():
            p.error(f"--merge {path}: no such file; give an earlier --out of this probe")
        earlier = json.loads(Path(path).read_text())
        runs += [{"from": earlier["command"], "commit": earlier["commit"], **r} for r in earlier["runs"]]
    for spec in a.from_metrics:
        variant, seed, path = (spec.split(":", 2) + ["", ""])[:3]
        if variant not in VARIANTS or not seed.isdigit() or not Path(path).is_file():
            p.error(
                f"--from-metrics {spec}: give VARIANT:SEED:PATH with a variant of {', '.join(VARIANTS)}, an integer "
                "seed and an existing metrics.jsonl"
            )
        runs.append({**summarize(variant, int(seed), Path(path)), "from": f"metrics {path}"})
    if runs:
        write(a.out, runs, commit, a.note)
    lock = threading.Lock()  # --jobs runs finish in their own threads: one append and rewrite at a time

    def one(vs):  # the json is rewritten after every run: a stopped probe keeps what it finished
        result = run(vs[0], vs[1], a.steps)
        with lock:
            runs.append(result)
            write(a.out, runs, commit, a.note)

    with ThreadPoolExecutor(a.jobs) as pool:
        list(pool.map(one, todo))
    print(f"wrote {a.out}")


def write(path: str, runs: list[dict], commit: str, notes: list[str]) -> None:
    out = {
        "what": "CPU probe of the learning task's loop separation at debug-small: Ouro's default model settings with "
        "one or more loop-separating settings switched on (" + __doc__.split("\n")[0] + ")",
        "command": " ".join(["python", "benchmarks/probes/loop_separation.py", *sys.argv[1:]]),
        "train_command": " ".join(["OMP_NUM_THREADS=1 python", *TORCHRUN, *BASE]),
        "commit": commit,
        "torch": __import__("torch").__version__,
        "notes": notes,
        "runs": sorted(runs, key=lambda r: (list(VARIANTS).index(r["variant"]), r["seed"])),
    }
    tmp = Path(f"{path}.tmp")  # written whole, then moved: a probe stopped mid-write leaves the last json intact
    tmp.write_text(json.dumps(out, indent=1) + "\n")
    os.replace(tmp, path)


if __name__ == "__main__":
    main()
