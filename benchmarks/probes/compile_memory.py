#!/usr/bin/env python3
"""How much of a training step's peak memory torch.compile removes, on the CPU, beside the memory plan.

    python benchmarks/probes/compile_memory.py --out compile_memory_cpu.json       # about 15 minutes on 2 cores

The memory plan (titanloop.train.memory_plan) traces the step eagerly: Dynamo does not trace under its tracker. The
shipped configs compile every layer, and inductor keeps fewer tensors for the backward (fused elementwise chains,
no fp32 copies inside the norms). This probe runs one real optimizer step (2 micro-batches, bf16, one gloo rank) of
a small LoopLM at 4K tokens per sequence, eager and compiled, with and without per-loop activation checkpointing,
and records each step's resident-set peak (VmHWM, reset after two warm-up steps, glibc told to give freed memory
back at once) beside the plan of the same config. It is a probe, not a benchmark: CPU kernels are not CUDA kernels,
so it says which way and roughly how far compile moves the peak, which the GPU's memory runs (gpu_check) measure.
The plan beside both is the eager config's (the plan of a compiled config subtracts compile's saving; the
benchmarks/results/gpu/*-plan-vs-peak records set such plans against an H100's peaks).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import itertools
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # this checkout's titanloop, when run as a script

from titanloop.train.launch import torchrun  # noqa: E402

CONFIG = ROOT / "train_configs" / "debug.toml"
SHAPE = {  # 2 layers x T = 4 at hidden 512, 4K tokens: activations, not code or parameters, make the peak
    "model.hidden_size": 512,
    "model.ffn_hidden_size": 1408,
    "model.n_heads": 8,
    "model.max_seq_len": 4096,
    "model.vocab_size": 8192,
    "training.seq_len": 4096,
    "training.micro_batch_size": 2,
    "training.global_batch_size": 4,
    "training.doc_masking": "false",
    "training.dtype": "bfloat16",
}
ACS = ("none", "loop")


def overrides(ac: str, compiled: bool) -> list[str]:
    args = {**SHAPE, "parallelism.activation_checkpoint": ac, "parallelism.compile": str(compiled).lower()}
    return [x for k, v in args.items() for x in (f"--{k}", str(v))]


def _status(field: str) -> int:
    return int(re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1)) * 1024


def worker(out: str, ac: str, compiled: bool) -> None:
    """A torchrun rank: the trainer's model, optimizer and step (titanloop.train.loop) on real tensors."""
    import torch

    from titanloop.train.config import load_config
    from titanloop.train.engines import FSDP2Engine, build_lr_schedulers, build_optimizer, init_weights, parallelize
    from titanloop.train.loop import accumulate_gradients, max_norm
    from titanloop.train.memory_plan import _fake_run
    from titanloop.train.startup import build_model, init_mesh, param_dtype

    cfg = load_config(CONFIG, overrides(ac, compiled), world_size=1)
    mesh = init_mesh(cfg)
    model = parallelize(cfg.engine_settings(), build_model(cfg), mesh, param_dtype(cfg, "cpu"), device_type=None)
    init_weights(model, mesh.device)
    optimizers = build_optimizer(cfg.optimizer, model, 1, "cpu")
    engine = FSDP2Engine(model, optimizers, build_lr_schedulers(cfg.lr_scheduler, 10, optimizers))
    run = _fake_run(cfg, mesh, engine)
    t = cfg.training
    gen = torch.Generator().manual_seed(0)
    batch = {
        k: torch.randint(0, SHAPE["model.vocab_size"], (t.micro_batch_size, t.seq_len), generator=gen)
        for k in ("input_ids", "labels")
    }
    batch["doc_ids"] = torch.zeros(t.micro_batch_size, t.seq_len, dtype=torch.long)
    n_loops = cfg.loop_sampler.bounds()[1]

    def step() -> None:
        accumulate_gradients(run, itertools.repeat(batch), n_loops, 2)
        engine.step(max_norm(cfg))

    step()
    step()  # (compiled, and the optimizer state exists)
    gc.collect()
    base = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := the current resident set
    step()
    Path(out).write_text(json.dumps({"peak_bytes": _status("VmHWM") - base}))


def plan_bytes(ac: str) -> int:
    from titanloop.train.config import load_config
    from titanloop.train.dry_run import dry_run

    return int(dry_run(load_config(CONFIG, overrides(ac, False), world_size=1), 1, memory_plan=True).memory_plan.peak)


def git_commit() -> str | None:
    proc = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return proc.stdout.strip() or None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        from titanloop.train.process_exit import exit_without_teardown

        worker(argv[1], argv[2], argv[3] == "true")
        exit_without_teardown(0)  # a gloo rank: its native threads can abort the teardown (SIGABRT)
    p = argparse.ArgumentParser(
        prog="python benchmarks/probes/compile_memory.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", type=Path, required=True, help="the json to write")
    a = p.parse_args(argv)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": str(ROOT)}
    rows = []
    for ac in ACS:
        start = time.perf_counter()
        planned = plan_bytes(ac)
        print(f"plan, AC {ac}: {planned / 1e6:.0f} MB ({time.perf_counter() - start:.0f} s)", flush=True)
        for compiled in (False, True):
            start, out = time.perf_counter(), a.out.with_name(a.out.stem + f".{ac}.{compiled}.tmp")
            cmd = torchrun(1, str(Path(__file__).resolve()), "--worker", str(out), ac, str(compiled).lower())
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
            if proc.returncode != 0:
                print(f"error: the AC {ac} compiled={compiled} step failed: {proc.stderr.strip()[-500:]}")
                return 1
            peak = json.loads(out.read_text())["peak_bytes"]
            out.unlink()
            rows.append({"ac": ac, "compiled": compiled, "peak_bytes": peak, "plan_bytes": planned})
            print(
                f"AC {ac}, {'compiled' if compiled else 'eager'}: peak {peak / 1e6:.0f} MB, plan {planned / 1e6:.0f} "
                f"MB ({planned / peak - 1:+.0%}) ({time.perf_counter() - start:.0f} s)",
                flush=True,
            )
    import torch

    ratios = {
        ac: next(r["peak_bytes"] for r in rows if r["ac"] == ac and r["compiled"])
        / next(r["peak_bytes"] for r in rows if r["ac"] == ac and not r["compiled"])
        for ac in ACS
    }
    doc = {
        "command": "python benchmarks/probes/compile_memory.py " + " ".join(argv),
        "device": "CPU, one gloo rank",
        "torch": torch.__version__,
        "commit": git_commit(),
        "date": datetime.date.today().isoformat(),
        "shape": SHAPE,
        "rows": rows,
        "compiled_over_eager_peak": ratios,
    }
    a.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"compiled / eager peak: {', '.join(f'AC {k} {v:.2f}' for k, v in ratios.items())}; wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
