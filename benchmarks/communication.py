"""Communication per optimizer step of looped training, counted on real gloo processes.

Runs the real trainer (`torchrun -m titanloop.train`, debug config, `--metrics.count_comms true`, which
wraps each step in torch's CommDebugMode) for several layouts and reads the per-step collective counts
from the run's metrics.jsonl:

    FSDP (2 ranks), looped stack gathered once per step  (parallelism.reshard_looped = "never", the default)
    FSDP (2 ranks), resharded after every use            (reshard_looped = "always": 2T gathers per layer)
    TP (2 ranks), 2-D FSDP x TP (4 ranks)
    the same parameters without looping (T = 1)          (the baseline a looped model should match)

CommDebugMode counts calls, not bytes; bytes per step are computed from the model's parameter sizes for the
FSDP rows (all-gather and reduce-scatter move one copy of the sharded parameters each).

    python benchmarks/communication.py [--steps 3] [--out comm.json]

--out writes the result in the benchmarks/report.py schema (the script's raw figures under "result"). Counts do
not depend on machine load: one run gives them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import machine, regen_command, write_report  # noqa: E402
from titanloop.model.config import preset  # noqa: E402
from titanloop.train.launch import torchrun  # noqa: E402

# table label of each layout
LABELS = {
    "fsdp2 looped (gather once)": "FSDP, looped stack gathered once per step (default)",
    "fsdp2 looped (reshard always)": "FSDP, resharded after every use",
    "fsdp2 non-looped baseline (T=1)": "FSDP, same parameters without looping (T = 1)",
    "tp2 looped": "TP 2 (+ sequence parallel)",
    "fsdp2 x tp2 looped": "FSDP 2 x TP 2",
}
LAYOUTS = [
    # name, nproc, overrides
    ("fsdp2 looped (gather once)", 2, ["--parallelism.reshard_looped", '"never"']),
    ("fsdp2 looped (reshard always)", 2, ["--parallelism.reshard_looped", '"always"']),
    ("fsdp2 non-looped baseline (T=1)", 2, ["--loop_sampler.n_loops", "1"]),
    ("tp2 looped", 2, ["--parallelism.tp", "2"]),
    ("fsdp2 x tp2 looped", 4, ["--parallelism.tp", "2"]),
]


def run_layout(name: str, nproc: int, overrides: list[str], steps: int, workdir: Path) -> dict:
    run_dir = workdir / name.replace(" ", "_").replace("(", "").replace(")", "").replace("=", "")
    cmd = torchrun(
        nproc,
        "-m",
        "titanloop.train",
        "--config",
        str(ROOT / "train_configs" / "debug.toml"),
        "--training.run_dir",
        f'"{run_dir}"',
        "--training.steps",
        str(steps),
        "--metrics.log_freq",
        "1",
        "--metrics.count_comms",
        "true",
        "--metrics.wandb",
        '"off"',
        "--checkpoint.enable",
        "false",
        "--training.global_batch_size",
        "16",
        "--training.micro_batch_size",
        "8",
        *overrides,
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"error: layout {name!r} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = rows[-1]  # a steady-state step (the first one may include warm-up collectives)
    comms = {k.split("/", 1)[1]: v for k, v in last.items() if k.startswith("comm/")}
    return {"layout": name, "nproc": nproc, "step": last["step"], "n_loops": last["n_loops"], "comms": comms}


def run(steps: int = 3) -> dict:
    cfg = preset("debug-tiny")
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run_layout(n, p, o, steps, Path(tmp)) for n, p, o in LAYOUTS]
    layer_bytes = cfg.layer_params() * 4
    return {
        "benchmark": "communication",
        "model": "debug-tiny",
        "n_layers": cfg.n_layers,
        "n_loops": cfg.n_loops,
        "looped_layer_fp32_bytes": layer_bytes,
        "rows": rows,
    }


def print_table(res: dict) -> None:
    kinds = sorted({k for r in res["rows"] for k in r["comms"]})
    print(
        f"Collectives per optimizer step, per rank (debug-tiny: {res['n_layers']} looped layers x "
        f"{res['n_loops']} loops; CommDebugMode counts)"
    )
    print(f"{'layout':<34} {'procs':>5} {'T':>2} " + " ".join(f"{k[:22]:>22}" for k in kinds))
    for r in res["rows"]:
        print(
            f"{r['layout']:<34} {r['nproc']:>5} {r['n_loops']:>2} "
            + " ".join(f"{r['comms'].get(k, 0):>22}" for k in kinds)
        )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3, help="optimizer steps per layout (the last is reported)")
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    if a.steps < 2:
        p.error(f"--steps={a.steps}: need at least 2 (the first step includes warm-up collectives)")
    res = run(a.steps)
    print_table(res)
    if a.out:
        write_report(a.out, "communication", to_report(res, regen_command("communication", argv)))
    return 0


def to_report(res: dict, command: str) -> dict:
    by = {r["layout"]: r for r in res["rows"]}
    gathers = {name: r["comms"].get("all_gather", 0) for name, r in by.items()}
    once, always = gathers["fsdp2 looped (gather once)"], gathers["fsdp2 looped (reshard always)"]
    base = gathers["fsdp2 non-looped baseline (T=1)"]
    t, n_layers = by["fsdp2 looped (reshard always)"]["n_loops"], res["n_layers"]
    expect_always = 1 + 2 * t * n_layers
    main_kinds = ["all_gather", "all_reduce", "reduce_scatter"]
    kinds = main_kinds + sorted({k for r in res["rows"] for k in r["comms"]} - set(main_kinds))
    reduces = by["fsdp2 looped (gather once)"]["comms"].get("all_reduce", 0)
    return {
        "title": "Communication (`benchmarks/communication.py`)",
        "order": 40,
        "command": command,
        "machine": machine() + ", gloo",
        "summary": [
            {
                "row": 'FSDP all-gathers per step, looped stack gathered once (`reshard_looped="never"`)',
                "measured": f"{once} ({'=' if once == base else '!='} non-looped T=1 model: {base})",
                "target": "= non-looped",
                "met": once == base,
            },
            {
                "row": "FSDP all-gathers per step, resharded after every use",
                "measured": f"{always} ({'=' if always == expect_always else '!='} 1 + 2·T·L = {expect_always})",
                "target": None,
                "met": None,
            },
        ],
        "tables": [
            {
                "title": "Collectives per optimizer step per rank (`CommDebugMode`, real trainer, "
                f"{res['model']}: {n_layers} looped layers x T={res['n_loops']}; step {res['rows'][0]['step']}):",
                "columns": ["layout", "procs", "T", *(k.replace("_", "-") for k in kinds)],
                "rows": [
                    [LABELS.get(r["layout"], r["layout"]), r["nproc"], r["n_loops"]]
                    + [r["comms"].get(k, 0) for k in kinds]
                    for r in res["rows"]
                ],
            }
        ],
        "notes": [
            f'With `reshard_looped = "never"` the looped model issues {once} all-gathers per step against {base} for '
            f"the same parameters without looping (L = {n_layers} looped layers, T = {t}); resharding after every "
            f"use issues {always}. TP collectives are activations, so they scale with T x layers by nature (each "
            "loop runs the layers' sequence-parallel gathers and scatters again). The "
            f"{reduces} all-reduce(s) of the FSDP row are the trainer's packed loss / statistics and the gradient "
            "norm. CommDebugMode counts calls, not bytes.",
        ],
        "result": res,
    }


if __name__ == "__main__":
    sys.exit(main())
