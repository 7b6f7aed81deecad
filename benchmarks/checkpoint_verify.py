"""Checkpoint save / verify / load seconds per GB at 1 and 2 ranks (titanloop.checkpoint, FSDP2-sharded model
with AdamW state), to show that the crc32 check before a load is spread over the ranks (Checkpointer.verify).

    python benchmarks/checkpoint_verify.py [--hidden 768] [--layers 4]     (launches torchrun itself)

Writes benchmarks/results/checkpoint_verify.json. Times are wall seconds on this machine's disk (page cache
warm: a checkpoint just written is read back from memory), so the ratios between ranks matter, not the GB/s.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.report import measured_commit  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def worker(hidden: int, layers: int, out: str) -> None:
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
    engine = build_engine(cfg, build_model(cfg), mesh, torch.float32)
    for p in engine.model.parameters():  # create the AdamW state
        p.grad = torch.zeros_like(p)
    engine.step(float("inf"))
    run_dir = Path(out).parent / "run"
    ckpt = Checkpointer(CheckpointConfig(enable=True, mode="sync", keep_last=2), run_dir, engine.checkpoint_states())
    times = {}
    for name, fn in [("save", lambda: ckpt.save(1, sync=True)), ("verify", None), ("load", lambda: ckpt.load(1))]:
        if name == "verify":
            step_dir = ckpt.root / layout.step_dir_name(1)
            manifest = layout.read_manifest(step_dir)
            fn = lambda: ckpt.verify(step_dir, manifest)  # noqa: E731
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        times[name] = time.perf_counter() - start
    size = sum(f.stat().st_size for f in (ckpt.root / layout.step_dir_name(1)).iterdir())
    ckpt.close()
    if mesh.rank == 0:
        Path(out).write_text(json.dumps({"world": world, "bytes": size, **times}))
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--out", default=str(REPO / "benchmarks/results/checkpoint_verify.json"))
    args = ap.parse_args(argv)
    rows = []
    for world in (1, 2):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "times.json"
            env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--standalone",
                    f"--nproc_per_node={world}",
                    __file__,
                    "--worker",
                    str(args.hidden),
                    str(args.layers),
                    str(out),
                ],
                env=env,
                check=True,
            )
            r = json.loads(out.read_text())
        gb = r["bytes"] / 1e9
        rows.append([world, f"{gb:.2f}"] + [f"{r[k] / gb:.2f}" for k in ("save", "verify", "load")])
        print(rows[-1], flush=True)
    result = {
        "title": "Checkpoint save / verify / load, seconds per GB (`benchmarks/checkpoint_verify.py`)",
        "order": 61,
        "command": "python benchmarks/checkpoint_verify.py",
        "date": datetime.date.today().isoformat(),
        "commit": measured_commit("checkpoint_verify"),
        "machine": "2-core development VM, CPU only, gloo, local disk, other jobs running",
        "summary": [],
        "tables": [
            {
                "title": f"LoopLM hidden {args.hidden}, {args.layers} layers, vocab 32768, FSDP2 over the ranks, "
                "AdamW state; sync save (DCP write + fsync + crc32 + publish), verify (sizes + crc32 "
                "of this rank's share, Checkpointer.verify), load (verify + DCP read):",
                "columns": ["ranks", "checkpoint GB", "save s/GB", "verify s/GB", "load s/GB"],
                "rows": rows,
            }
        ],
        "notes": [
            "verify is the slowest rank's share: with N ranks each reads ~1/N of the bytes; before this change "
            "rank 0 read all of them."
        ],
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        sys.path.insert(0, str(REPO))
        worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    else:
        sys.exit(main())
