"""Per-GPU memory plan of Ouro-1.4B / 2.6B on 8 x H100 (titanloop.train.memory_plan), and of every stage config
at its sbatch size; and (--network) the network bytes per step. Each writes a new dated record,
benchmarks/results/<date>-<machine>-memory-plan.json or -network-per-step.json (or --out).

    python benchmarks/memory_plan.py [--quick] [--direct-shapes] [--stages gate_stage2.sh,...] [--out f.json]
    python benchmarks/memory_plan.py --network

Each entry is the trainer's own step measured on fake tensors (FSDPMemTracker) at world size 8 (or the stage's),
bf16 parameters as on GPU. The stage configs are measured directly at their full depth and world size; the shape
table too with `--direct-shapes` (about an hour on 2 cores; `--shape-presets` and `--merge-from` split it over
two processes). Without it the shape table's looped stack is measured at 1 and 2 layers and extrapolated linearly
to 24 / 48 layers, marked in the row: exact without activation checkpointing, an underestimate with per-loop AC,
where the step's peak moves between phases as depth grows (stage3_longct: 7.3 GB extrapolated, 38.2 GB direct).
`--check-depth` measures one configuration at 4 layers directly and reports the extrapolation's error.
`--keep-existing RECORD [--remeasure-stages]` keeps the rows of an earlier record and measures only the missing
ones (or every stage row again).

--network: network bytes per optimizer step per GPU for the FSDP stage configs, and the step-time floor at 400 Gb/s
(a record of its own, <date>-<machine>-network-per-step.json). The trainer's step
(titanloop.train.memory_plan.measure_step: loop.forward_objective, engine.backward, engine.step) runs on fake
tensors on the dry run's fake process group, with the collective byte counter
(titanloop.parallel.comm_count.count_collective_bytes) on the second step. Ouro-1.4B layer shape, bf16 parameters,
fp32 gradient reduction, 4K tokens, micro-batch 1. Measured at 2 and 4 ranks, 1 and 2 looped layers, T = 1, 4 and 8,
1, 2 and 3 micro-batches; the counts are then extrapolated to each FSDP-only stage config at its sbatch size: buffer
bytes = fixed + per layer x layers (+ the accumulation surcharge per looped layer when a step has >= 2 micro-
batches, see the notes in the json), and each GPU sends (N-1)/N of every all-gather / reduce-scatter buffer (ring).
Bytes do not depend on machine load: one run gives them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import record_path, regen_command, stamp, write_report  # noqa: E402

import torch  # noqa: E402

from titanloop.checks.runs import fresh_path  # noqa: E402
from titanloop.parallel.activation_checkpoint import describe as describe_ac  # noqa: E402
from titanloop.train.config import load_config  # noqa: E402
from titanloop.train.dry_run import fake_mesh, plan_of, slurm_stages  # noqa: E402
from titanloop.train.memory_plan import GB, measure_step  # noqa: E402

SHAPES = [("ouro-1.4b", 24), ("ouro-2.6b", 48)]
# rows that are sums over layers (linear in depth); the rest of the peak is activations + temporaries
LINEAR = {
    "parameters": ["parameters (sharded)", "parameters (gathered)"],
    "gradients": ["gradients (sharded)", "gradients (gathered)"],
    "optimizer": ["optimizer"],
}
ROWS = [*LINEAR, "activations + temporaries"]


def plan_at(config: str | None, overrides: list[str], world: int, n_layers: int) -> dict:
    p = plan_of(load_config(config, overrides + ["--model.n_layers", str(n_layers)], world_size=world), world)
    return {**p.rows, "peak": p.peak}


def measured(config, overrides, world) -> tuple[dict, dict]:
    return plan_at(config, overrides, world, 1), plan_at(config, overrides, world, 2)


def extrapolated(pair: tuple[dict, dict], depth: int) -> dict:
    a, b = pair
    return grouped({k: a[k] + (b[k] - a[k]) * (depth - 1) for k in a})


def grouped(out: dict) -> dict:
    """A plan's rows summed into the table's columns (ROWS) and the peak."""
    rows = {name: sum(out[k] for k in keys) for name, keys in LINEAR.items()}
    rows["activations + temporaries"] = out["peak"] - sum(rows.values())
    return {**rows, "peak": out["peak"]}


DIRECT, EXTRAPOLATED = "direct", "extrapolated from 1-2 layers (lower bound)"
SHAPE_COLUMNS = ["model", "T", "seq", "AC", "micro-batch"] + ROWS + ["peak", "fits 80 GB", "measured"]


def shape_row(preset: str, n_loops: int, seq: int, ac: str, r: dict, how: str) -> list:
    return (
        [preset, n_loops, seq, ac, 1]
        + [f"{r[k] / GB:.1f}" for k in ROWS]
        + [f"{r['peak'] / GB:.1f}", "yes" if r["peak"] / GB + 4 <= 80 else "no", how]
    )


def shape_overrides(preset: str, n_loops: int, seq: int, ac: str, micro: int) -> list[str]:
    return [
        "--model.preset",
        preset,
        "--loop_sampler.n_loops",
        str(n_loops),
        "--training.seq_len",
        str(seq),
        "--training.micro_batch_size",
        str(micro),
        "--training.global_batch_size",
        str(8 * micro * 2),
        "--parallelism.activation_checkpoint",
        ac,
        "--training.dtype",
        "bfloat16",
    ]


def write(args, rows, stage_rows, notes) -> None:
    result = {
        "title": "Per-GPU memory plan, 8 x H100 (`benchmarks/memory_plan.py`)",
        "command": regen_command("memory_plan", args.argv),
        "machine": "2-core development VM, CPU only: fake tensors, nothing allocated",
        "summary": [],
        "tables": [
            {
                "title": "Every slurm/*.sh stage config at its sbatch size, its own micro-batch, GB per GPU at the "
                "step's peak (fits: peak + 4 GB reserve <= 80 GB):",
                "columns": ["script", "GPUs", "mesh", "T", "seq", "AC", "micro-batch"]
                + ROWS
                + ["peak GB", "fits 80 GB"],
                "rows": stage_rows,
            },
            {
                "title": "Ouro shapes at world size 8 (dp_shard 8), micro-batch 1, bf16 parameters, fp32 master "
                "weights and AdamW state, reshard_looped = never, fused attention; GB per GPU at the step's peak:",
                "columns": SHAPE_COLUMNS,
                "rows": rows,
            },
        ],
        "notes": notes
        + [
            "Measured by the code of `python -m titanloop.train --config C --dry-run --world-size N --memory-plan` "
            "(titanloop.train.memory_plan): the stage configs directly at their full depth and world size; each "
            "shape row's `measured` column says whether it was measured directly at 24 / 48 layers "
            "(--direct-shapes) or extrapolated linearly from 1 and 2 layers, which is exact without AC but "
            "underestimates with per-loop AC.",
            "Gradients show 0 at the peak: the peak is inside forward/backward, when the previous step's sharded "
            "gradients are already freed (zero_grad) and this step's are not reduced yet.",
            "Validated against real CPU runs at 1 and 2 ranks and dp 1 x tp 2 in tests/test_train_memory_plan.py "
            "(bf16 + fp32 reduce, per-loop AC, document masking; the band is in the test).",
            "Not included: the CUDA/NCCL context and allocator fragmentation (the 4 GB reserve); document masking "
            "(planned as causal attention, same memory with flash varlen). torch.compile: compiled configs subtract "
            "what compile saves where the plan models it (not with TP), as its notes say (docs/scaling.md).",
        ],
    }
    Path(args.out).write_text(json.dumps(stamp(result), indent=1) + "\n")  # rewritten as rows arrive


LINK = 400e9 / 8  # bytes/s per GPU


def count(world: int, layers: int, n_loops: int, micro_batches: int) -> dict:
    cfg = load_config(
        None,
        [
            "--model.preset",
            "ouro-1.4b",
            "--model.n_layers",
            str(layers),
            "--loop_sampler.n_loops",
            str(n_loops),
            "--training.seq_len",
            "4096",
            "--training.micro_batch_size",
            "1",
            "--training.global_batch_size",
            str(world * micro_batches),
            "--training.doc_masking",
            "false",
            "--parallelism.activation_checkpoint",
            "loop",
        ],
        world_size=world,
    )
    with fake_mesh(cfg, world) as mesh:
        c: Counter = Counter()
        measure_step(cfg, mesh, torch.bfloat16, micro_batches=micro_batches, comm_bytes=c)
    r = {k: int(c.get(k, 0)) for k in ("all_gather", "reduce_scatter", "all_reduce")}
    print(world, layers, n_loops, micro_batches, r, flush=True)
    return r


def network(args, argv) -> int:
    """--network: collective bytes per optimizer step, checked and extrapolated to the FSDP-only stage configs."""
    base = count(4, 1, 4, 1)
    runs = {
        "base (4 ranks, 1 layer, T=4, 1 micro-batch)": base,
        "2 ranks": count(2, 1, 4, 1),
        "2 layers": count(4, 2, 4, 1),
        "T=8": count(4, 1, 8, 1),
        "2 micro-batches": count(4, 1, 4, 2),
        "3 micro-batches": count(4, 1, 4, 3),
        "T=1, 2 micro-batches": count(4, 1, 1, 2),
        "2 layers, 2 micro-batches": count(4, 2, 4, 2),
    }
    keys = ("all_gather", "reduce_scatter")
    per_layer = {k: runs["2 layers"][k] - base[k] for k in keys}
    # Gradient accumulation (>= 2 micro-batches) with T >= 2: FSDP2 reduce-scatters each looped layer's gradient
    # twice in the last backward (once with the gradient accumulated so far, once with the rest; the sum is the same
    # gradient), whatever the number of micro-batches: a fixed surcharge per looped layer, not per micro-batch.
    accum_extra = {k: runs["2 micro-batches"][k] - base[k] for k in keys}
    # FSDP2 pads each shard to a whole number of rows per rank: the buffers differ by that padding across N
    predicted = {k: base[k] + per_layer[k] + 2 * accum_extra[k] for k in keys}  # the stage-row formula below
    checks = {
        "independent of the world size (2 vs 4 ranks, within 0.1%: shard padding)": all(
            abs(runs["2 ranks"][k] - base[k]) <= 1e-3 * base[k] for k in keys
        ),
        "independent of T (4 vs 8 loops)": all(runs["T=8"][k] == base[k] for k in keys),
        "independent of the number of micro-batches >= 2 (2 vs 3)": all(
            runs["3 micro-batches"][k] == runs["2 micro-batches"][k] for k in keys
        ),
        "of 2 layers x 2 micro-batches as extrapolated (fixed + per layer + surcharge per looped layer)": all(
            runs["2 layers, 2 micro-batches"][k] == predicted[k] for k in keys
        ),
    }
    rows = []
    for name, config, world, overrides in slurm_stages(REPO, retrofit=False):
        cfg = load_config(REPO / config, overrides, world_size=world)
        if cfg.parallelism.tp != 1 or cfg.looplm.hidden_size != 2048 or cfg.parallelism.engine != "fsdp2":
            continue  # TP stages also move activations, DeepSpeed's ZeRO other buffers: not extrapolated here
        t = cfg.training
        accum = t.global_batch_size // (t.micro_batch_size * world)
        layers = cfg.looplm.n_layers
        buf = {k: base[k] + per_layer[k] * (layers - 1) + (accum_extra[k] * layers if accum > 1 else 0) for k in keys}
        if cfg.objective.name == "stage2_gate":
            continue  # frozen LM: only the gate's gradients are reduced
        sent = sum(buf.values()) * (world - 1) / world
        rows.append(
            [
                name,
                world,
                layers,
                cfg.loop_sampler.n_loops,
                accum,
                f"{buf['all_gather'] / 1e9:.2f}",
                f"{buf['reduce_scatter'] / 1e9:.2f}",
                f"{sent / 1e9:.2f}",
                f"{sent / LINK:.2f}",
            ]
        )
        print(rows[-1], flush=True)
    result = {
        "title": "Network bytes per step per GPU, FSDP stages (`benchmarks/memory_plan.py --network`)",
        "command": regen_command("memory_plan", argv),
        "machine": "2-core development VM: fake tensors on the fake backend, nothing sent",
        "summary": [
            {"row": f"collective bytes per step {name}", "measured": ok, "target": True, "met": ok}
            for name, ok in checks.items()
        ],
        "tables": [
            {
                "title": "Measured buffer bytes per step (all-gather output, reduce-scatter input), Ouro-1.4B layer "
                "shape:",
                "columns": ["run", "all-gather bytes", "reduce-scatter bytes"],
                "rows": [[name, r["all_gather"], r["reduce_scatter"]] for name, r in runs.items()],
            },
            {
                "title": "Extrapolated to the FSDP-only stage configs at their sbatch size (end of the batch ramp); "
                "GB per GPU per step, floor = bytes sent / 400 Gb/s:",
                "columns": [
                    "script",
                    "GPUs",
                    "layers",
                    "T",
                    "micro-batches",
                    "all-gather GB",
                    "reduce-scatter GB",
                    "sent per GPU GB",
                    "floor s/step",
                ],
                "rows": rows,
            },
        ],
        "notes": [
            "With reshard_looped = never each parameter is all-gathered once per optimizer step (bf16; the "
            "looped layers stay gathered across micro-batches) and its gradient reduce-scattered once per step "
            "(fp32): the count does not depend on T.",
            "Exception, measured here and not fixed: with gradient accumulation (>= 2 micro-batches) and T >= 2, "
            "FSDP2 reduce-scatters each looped layer's gradient twice in the last backward (rows '2 micro-"
            "batches' and '3 micro-batches' vs 'T=1, 2 micro-batches'): one extra reduce-scatter of the looped "
            "layers per step, whatever the number of micro-batches. The sum is the same gradient (the 8-rank "
            "parity test, tests/test_parallel_8rank.py, accumulates 2 micro-batches per rank); the stage rows "
            "include the surcharge.",
            "The counter is checked against a hand count (tests/test_parallel_mixed_precision.py: debug model, 2 "
            "ranks, 2 layers: all-gather 2 B and reduce-scatter 4 B per padded parameter element, exactly). Until "
            "2026-11-25 it counted FSDP2's all-gather twice (its all_gather_single wrapper and the c10d op "
            "the dispatcher also sees), so earlier all-gather figures were 2x high; the reduce-scatter "
            "figures were right (the 'open question' of 2026-11-24: reduce-scatter equal to the bf16 "
            "all-gather was the all-gather doubled).",
            "Not covered: tensor-parallel stages (stage2/3/4 move activations inside a node over NVLink), "
            "the loss all-reduce (a few hundred bytes), overlap of communication with compute.",
        ],
    }
    write_report(args.out, "network_per_step", result)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--network", action="store_true", help="network bytes per step instead of memory (see above)")
    ap.add_argument("--quick", action="store_true", help="only 4K rows and the 1.4B stage configs")
    ap.add_argument("--stages", help="only these stage configs (comma-separated slurm script names; '' for none)")
    ap.add_argument("--check-depth", action="store_true")
    ap.add_argument("--rows-from", help="a log of an earlier run: its printed shape rows are reused")
    ap.add_argument(
        "--keep-existing",
        metavar="RECORD",
        help="keep the rows of this earlier record; measure only the missing ones (e.g. stage configs added since)",
    )
    ap.add_argument(
        "--direct-shapes",
        action="store_true",
        help="measure the shape table at full depth (24 / 48 "
        "layers) instead of extrapolating; about an hour on 2 cores",
    )
    ap.add_argument("--shape-presets", help="with --direct-shapes: only these presets, e.g. ouro-2.6b")
    ap.add_argument(
        "--merge-from",
        nargs="*",
        help="take the direct shape rows of these result files (other runs "
        "of this benchmark, e.g. one per preset in parallel)",
    )
    ap.add_argument(
        "--remeasure-stages",
        action="store_true",
        help="with --keep-existing: keep the shape rows, measure every stage config again",
    )
    ap.add_argument("--out", help="write the record here (default: a new dated record in benchmarks/results/)")
    args = ap.parse_args(argv)
    args.argv = argv
    if args.network:
        return network(args, argv)
    args.out = fresh_path(args.out) if args.out else record_path("memory_plan")  # never an existing record
    only_stages = None if args.stages is None else {x for x in args.stages.split(",") if x}
    rows, stage_rows, notes = [], [], []
    if args.rows_from:
        import ast

        rows = [
            ast.literal_eval(line)
            for line in Path(args.rows_from).read_text().splitlines()
            if line.startswith("['ouro-")
        ]
    if args.keep_existing:  # rows of an earlier run of this benchmark are kept
        earlier = json.loads(Path(args.keep_existing).read_text())["tables"]
        stage_rows, rows = ([] if args.remeasure_stages else earlier[0]["rows"]), earlier[1]["rows"]
    planned = {r[0] for r in stage_rows}
    for name, config, world, overrides in slurm_stages(REPO, retrofit=False):
        cfg = load_config(REPO / config, overrides, world_size=world)
        if (args.quick and cfg.model.preset != "ouro-1.4b") or cfg.parallelism.engine != "fsdp2" or name in planned:
            continue
        if only_stages is not None and name not in only_stages:
            continue  # the plan measures the FSDP2 step (with TP where configured; not DeepSpeed ZeRO)
        r = grouped(plan_at(str(REPO / config), list(overrides), world, cfg.looplm.n_layers))  # full depth, direct
        t = cfg.training
        stage_rows.append(
            [
                name,
                world,
                f"dp {world // cfg.parallelism.tp} x tp {cfg.parallelism.tp}",
                cfg.loop_sampler.n_loops,
                t.seq_len,
                describe_ac(cfg.parallelism.activation_checkpoint, cfg.parallelism.ac_kept_loops),
                t.micro_batch_size,
            ]
            + [f"{r[k] / GB:.1f}" for k in ROWS]
            + [f"{r['peak'] / GB:.1f}", "yes" if r["peak"] / GB + 4 <= 80 else "no"]
        )
        print(stage_rows[-1], flush=True)
        write(args, rows, stage_rows, notes)
    rows = [r if len(r) == len(SHAPE_COLUMNS) else r + [EXTRAPOLATED] for r in rows]  # rows of earlier runs
    for other in args.merge_from or []:  # direct shape rows of another run of this benchmark (run in parallel)
        theirs = [r for r in json.loads(Path(other).read_text())["tables"][1]["rows"] if r[-1] == DIRECT]
        keys = {tuple(r[:4]) for r in theirs}
        rows = sorted([r for r in rows if tuple(r[:4]) not in keys] + theirs, key=lambda x: tuple(x[:4]))
    if args.direct_shapes:  # the shape rows at their full depth, 1.4B first; the json is rewritten after each
        for preset, depth in SHAPES:
            if args.shape_presets and preset not in args.shape_presets.split(","):
                continue
            for n_loops in (4, 8):
                for seq in (4096,) if args.quick else (4096, 16384):
                    for ac in ("none", "loop"):
                        key = [preset, n_loops, seq, ac]
                        if any(r[:4] == key and r[-1] == DIRECT for r in rows):
                            continue
                        r = grouped(plan_at(None, shape_overrides(preset, n_loops, seq, ac, 1), 8, depth))
                        row = shape_row(preset, n_loops, seq, ac, r, DIRECT)
                        rows = sorted([x for x in rows if x[:4] != key] + [row], key=lambda x: tuple(x[:4]))
                        print(row, flush=True)
                        write(args, rows, stage_rows, notes)
    done = {tuple(r[1:4]) for r in rows}
    # 1.4B and 2.6B share the layer shape (2.6B = 48 of the 24 layers of 1.4B): one measurement pair serves both
    for n_loops in (4, 8):
        for seq in (4096,) if args.quick else (4096, 16384):
            for ac in ("none", "loop"):
                if (n_loops, seq, ac) in done:
                    continue
                pair = measured(None, shape_overrides("ouro-1.4b", n_loops, seq, ac, 1), 8)
                for preset, depth in SHAPES:
                    r = extrapolated(pair, depth)
                    rows.append(shape_row(preset, n_loops, seq, ac, r, EXTRAPOLATED))
                    print(rows[-1], flush=True)
                write(args, rows, stage_rows, notes)
    if args.check_depth:
        over = shape_overrides("ouro-1.4b", 4, 4096, "loop", 1)
        direct = plan_at(None, over, 8, 4)["peak"]
        extra = extrapolated(measured(None, over, 8), 4)["peak"]
        notes.append(
            f"Depth extrapolation check (1.4B shape, T=4, 4K, AC loop, 4 layers): measured "
            f"{direct / GB:.2f} GB, extrapolated from 1 and 2 layers {extra / GB:.2f} GB "
            f"({(extra - direct) / direct:+.1%})."
        )
    rows.sort(key=lambda r: (r[0], r[1], r[2], r[3]))
    write(args, rows, stage_rows, notes)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
