"""Checkpoint save / verify / load seconds per GB at 1 and 2 ranks (titanloop.checkpoint, FSDP2-sharded model
with AdamW state), to show that the crc32 check before a load is spread over the ranks (Checkpointer.verify).

    python benchmarks/checkpoint_verify.py [--hidden 768] [--layers 4] [--repeats 3]   (launches torchrun itself)

Writes a new dated record, benchmarks/results/<date>-<machine>-checkpoint-verify.json (or --out). Times are wall seconds
on this machine's disk (page cache warm: a checkpoint just written is read back from memory), so the ratios between
ranks matter, not the GB/s; they depend on machine load, so each is min / median / max over --repeats save / verify /
load cycles."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import fmt_spread, machine, regen_command, spread, write_report  # noqa: E402
from titanloop.train.launch import torchrun  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def worker(hidden: int, layers: int, out: str, repeats: int = 1) -> None:
    import torch
    import torch.distributed as dist

    from titanloop.checkpoint import CheckpointConfig, Checkpointer, layout
    from titanloop.train.config import load_config
    from titanloop.train.engines import build_engine
    from titanloop.train.startup import build_model, init_mesh

    world = int(os.environ["WORLD_SIZE"])
    cfg = load_config(
        None,
        [
            "--model.preset",
            "debug-tiny",
            "--model.hidden_size",
            str(hidden),
            "--model.ffn_hidden_size",
            str(hidden * 3),
            "--model.n_layers",
            str(layers),
            "--model.vocab_size",
            "32768",
            "--training.global_batch_size",
            str(4 * world),
            "--training.micro_batch_size",
            "4",
        ],
        world_size=world,
    )
    mesh = init_mesh(cfg)
    engine = build_engine(cfg.engine_settings(), build_model(cfg), mesh, torch.float32)
    for p in engine.model.parameters():  # create the AdamW state
        p.grad = torch.zeros_like(p)
    engine.step(float("inf"))
    run_dir = Path(out).parent / "run"
    ckpt_cfg = CheckpointConfig(enable=True, mode="sync", keep_latest_k=2)
    ckpt = Checkpointer(ckpt_cfg, run_dir, engine.checkpoint_states())
    times = {"save": [], "verify": [], "load": []}
    for step in range(1, repeats + 1):
        step_dir = ckpt.root / layout.step_dir_name(step)
        for name in ("save", "verify", "load"):
            if name == "save":
                fn = lambda: ckpt.save(step, sync=True)  # noqa: E731
            elif name == "verify":
                manifest = layout.read_manifest(step_dir)
                fn = lambda: ckpt.verify(step_dir, manifest)  # noqa: E731
            else:
                fn = lambda: ckpt.load(step)  # noqa: E731
            dist.barrier()
            start = time.perf_counter()
            fn()
            dist.barrier()
            times[name].append(time.perf_counter() - start)
    size = sum(f.stat().st_size for f in (ckpt.root / layout.step_dir_name(repeats)).iterdir())
    ckpt.close()
    if mesh.rank == 0:
        Path(out).write_text(json.dumps({"world": world, "bytes": size, **times}))
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3, help="save / verify / load cycles per world size")
    ap.add_argument("--out", help="write the record here (default: a new dated record in benchmarks/results/)")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats={args.repeats}: must be >= 1")
    rows, raw = [], []
    for world in (1, 2):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "times.json"
            env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
            subprocess.run(
                torchrun(world, __file__, "--worker", str(args.hidden), str(args.layers), str(out), str(args.repeats)),
                env=env,
                check=True,
            )
            r = json.loads(out.read_text())
        raw.append(r)
        gb = r["bytes"] / 1e9
        per_gb = [fmt_spread(spread([t / gb for t in r[k]]), ".2f") for k in ("save", "verify", "load")]
        rows.append([world, f"{gb:.2f}", *per_gb])
        print(rows[-1], flush=True)
    result = {
        "title": "Checkpoint save / verify / load, seconds per GB (`benchmarks/checkpoint_verify.py`)",
        "command": regen_command("checkpoint_verify", argv),
        "machine": machine() + ", gloo, local disk",
        "summary": [],
        "tables": [
            {
                "title": f"LoopLM hidden {args.hidden}, {args.layers} layers, vocab 32768, FSDP2 over the ranks, "
                "AdamW state; sync save (DCP write + fsync + crc32 + publish), verify (sizes + crc32 "
                "of this rank's share, Checkpointer.verify), load (verify + DCP read); each cell min / median / max "
                f"over {args.repeats} cycles:",
                "columns": ["ranks", "checkpoint GB", "save s/GB", "verify s/GB", "load s/GB"],
                "rows": rows,
            }
        ],
        "notes": [
            "verify is the slowest rank's share: with N ranks each reads ~1/N of the bytes; before this change "
            "rank 0 read all of them."
        ],
        "result": {"runs": raw, "repeats": args.repeats},
    }
    write_report(args.out, "checkpoint_verify", result)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        sys.path.insert(0, str(REPO))
        from titanloop.train.process_exit import exit_without_teardown

        worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5]))
        exit_without_teardown(0)  # a gloo rank: its native threads can abort the teardown (SIGABRT)
    else:
        sys.exit(main())
