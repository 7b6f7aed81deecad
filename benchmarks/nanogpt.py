"""titanloop beside nanoGPT on nanoGPT's own CPU example: tinyshakespeare, character level, the "baby GPT" shape.

    python benchmarks/nanogpt.py --nanogpt ~/src/nanoGPT [--runs 3] [--out benchmarks/results/<date>-cpu-nanogpt.json]

nanoGPT comes from the user's checkout (`git clone https://github.com/karpathy/nanoGPT`); nothing of it is copied:
its train.py runs as published, from a work directory that holds its data files, and its model.py is imported to
score its checkpoint. Each run trains both on the same machine, one after the other (the order alternates from run
to run, so load hits both alike), with the same threads (every core, OMP_NUM_THREADS):

  nanoGPT    `train.py config/train_shakespeare_char.py` with the published CPU flags (PROVENANCE: --device=cpu
             --compile=False --eval_iters=20 --log_interval=1 --block_size=64 --batch_size=12 --n_layer=4 --n_head=4
             --n_embd=128 --max_iters=2000 --lr_decay_iters=2000 --dropout=0.0), plus --always_save_checkpoint=True
             (so the step-2000 model is kept) and its --out_dir (and --eval_interval=steps when --steps is no
             multiple of its 250); its data as its prepare.py writes it (train.bin,
             val.bin: the characters' ids as uint16; meta.pkl), from the same text and split.
  titanloop  `torchrun --nproc_per_node=1 -m titanloop.train --config train_configs/nanogpt_shakespeare_char.toml`
             (the same shape, schedule and batch; data from `python -m data_pipelines.corpora shakespeare_char`),
             with --training.seed / --data.seed = the run's index (nanoGPT's own seed is fixed at 1337).

A third row, titanloop with `--parallelism.compile true` (its decoder layers through torch.compile's inductor, which
fuses the Ouro layer's elementwise work), shows what titanloop's own fast path gives; its wall time includes the
compile (inductor's on-disk cache is warm after the first run).

Held-out loss: both final checkpoints are scored here the same way, on the whole validation split (the last 10% of
the characters, 111,540): consecutive windows of 64 characters, each predicting its 64 next characters, the mean
cross-entropy over all 111,488 targets. Speed: tokens per second of training (768 tokens a step) from the median
step time of each run (nanoGPT: its printed per-iteration times; titanloop: metrics.jsonl, one line per step), and
the wall time of each process from start to exit (start-up and evaluations included).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CONFIG = "train_configs/nanogpt_shakespeare_char.toml"
NANOGPT_FLAGS = [
    "--device=cpu",
    "--compile=False",
    "--eval_iters=20",
    "--log_interval=1",
    "--block_size=64",
    "--batch_size=12",
    "--n_layer=4",
    "--n_head=4",
    "--n_embd=128",
    "--max_iters=2000",
    "--lr_decay_iters=2000",
    "--dropout=0.0",
]
BLOCK, BATCH = 64, 12
WHO = ["nanogpt", "titanloop", "titanloop_compile"]  # the order of even runs (odd runs: reversed)
ITER_LINE = re.compile(r"^iter (\d+): loss [-0-9.naninf]+, time ([0-9.]+)ms")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python benchmarks/nanogpt.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--nanogpt", required=True, help="a checkout of karpathy/nanoGPT (holds train.py, model.py)")
    p.add_argument("--runs", type=int, default=3, help="runs of each (default 3); titanloop seeds 0..runs-1")
    p.add_argument("--steps", type=int, default=2000, help="training steps of both (default 2000, as published)")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="CPU threads (default: all)")
    p.add_argument("--work", default="runs/bench_nanogpt", help="work directory (default runs/bench_nanogpt)")
    p.add_argument(
        "--out", default=None, help="write the result json here (e.g. benchmarks/results/<date>-cpu-nanogpt.json)"
    )
    args = p.parse_args(argv)
    d = Path(args.nanogpt)
    missing = [
        f
        for f in ("train.py", "model.py", "configurator.py", "config/train_shakespeare_char.py")
        if not (d / f).is_file()
    ]
    if missing:
        p.error(f"--nanogpt {d}: no {missing[0]} there; pass a checkout of karpathy/nanoGPT")
    if args.runs < 1 or args.steps < 1 or args.threads < 1:
        p.error("--runs, --steps and --threads must be >= 1")
    return args


def corpus_text() -> tuple[str, str]:
    """tinyshakespeare split as nanoGPT's shakespeare_char: the first 90% of the characters, the rest."""
    text = (ROOT / "data" / "tinyshakespeare.txt").read_text(encoding="utf-8")
    cut = int(len(text) * 0.9)
    return text[:cut], text[cut:]


def nanogpt_stoi() -> dict[str, int]:
    """nanoGPT's character ids (its prepare.py: the sorted characters of the whole text)."""
    train, val = corpus_text()
    return {c: i for i, c in enumerate(sorted(set(train + val)))}


def prepare_nanogpt_data(work: Path) -> Path:
    """nanoGPT's data/shakespeare_char files (the format its prepare.py writes) in `work`, from the same text."""
    import numpy as np

    train, val = corpus_text()
    stoi = nanogpt_stoi()
    chars = list(stoi)
    data = work / "data" / "shakespeare_char"
    data.mkdir(parents=True, exist_ok=True)
    for name, part in (("train", train), ("val", val)):
        np.array([stoi[c] for c in part], dtype=np.uint16).tofile(data / f"{name}.bin")
    with open(data / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": stoi}, f)
    return work


def _timed(cmd: list[str], cwd: Path, env: dict, log: Path) -> float:
    start = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        tail = log.read_text().strip().splitlines()[-5:]
        raise SystemExit(f"error: {' '.join(cmd[:4])} ... exited {proc.returncode}; see {log}:\n" + "\n".join(tail))
    return seconds


def run_nanogpt(args, work: Path, i: int, env: dict) -> dict:
    d = Path(args.nanogpt).resolve()
    link = work / "configurator.py"  # train.py reads configurator.py from its working directory
    if not link.exists():
        link.symlink_to(d / "configurator.py")
    out_dir = work / f"out-{i}"
    flags = [f if not f.startswith("--max_iters=") else f"--max_iters={args.steps}" for f in NANOGPT_FLAGS]
    flags = [f if not f.startswith("--lr_decay_iters=") else f"--lr_decay_iters={args.steps}" for f in flags]
    cmd = [sys.executable, str(d / "train.py"), str(d / "config/train_shakespeare_char.py"), *flags]
    cmd += ["--always_save_checkpoint=True", f"--out_dir={out_dir}"]
    if args.steps % 250:  # it saves at its evaluations (every 250 iterations): evaluate at the last one too
        cmd.append(f"--eval_interval={args.steps}")
    log = work / f"nanogpt-{i}.log"
    wall = _timed(cmd, work, env, log)
    step_ms = [float(m.group(2)) for m in map(ITER_LINE.match, log.read_text().splitlines()) if m]
    return {"wall_s": wall, "step_ms": step_ms, "checkpoint": str(out_dir / "ckpt.pt")}


def run_titanloop(args, work: Path, i: int, env: dict, compiled: bool = False) -> dict:
    run_dir = work / f"titanloop{'-compile' if compiled else ''}-{i}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "-m", "titanloop.train"]
    cmd += ["--config", CONFIG, "--training.run_dir", str(run_dir), "--training.steps", str(args.steps)]
    cmd += ["--training.seed", str(i), "--data.seed", str(i), "--metrics.log_freq", "1"]
    cmd += ["--metrics.breakdown", "false", "--checkpoint.interval", str(args.steps)]
    cmd += ["--parallelism.compile", "true"] if compiled else []
    if run_dir.exists():
        raise SystemExit(f"error: {run_dir} exists: choose a new --work directory")
    wall = _timed(cmd, ROOT, env, run_dir.with_suffix(".log"))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step_ms = [1000 * BATCH * BLOCK / r["tokens_per_s"] for r in rows if "tokens_per_s" in r and r["step"] > 1]
    return {"wall_s": wall, "step_ms": step_ms, "checkpoint": str(run_dir / "checkpoints")}


def windows(ids: list[int]):
    """Consecutive (input, target) windows of BLOCK tokens over a token list, as [N, BLOCK] tensors."""
    import torch

    t = torch.tensor(ids, dtype=torch.long)
    n = (len(ids) - 1) // BLOCK
    return t[: n * BLOCK].view(n, BLOCK), t[1 : n * BLOCK + 1].view(n, BLOCK)


def heldout_loss(logits_of, x, y, batch: int = 128) -> float:
    """Mean cross-entropy of `logits_of(x_batch)` [B, S, V] against y over every window (summed in float64)."""
    import torch
    import torch.nn.functional as F

    total = 0.0
    with torch.no_grad():
        for s in range(0, len(x), batch):
            logits = logits_of(x[s : s + batch]).float()
            total += F.cross_entropy(logits.flatten(0, 1), y[s : s + batch].flatten(), reduction="sum").double().item()
    return total / y.numel()


def score_nanogpt(args, checkpoint: str, val: str) -> float:
    import torch

    sys.path.insert(0, str(Path(args.nanogpt).resolve()))
    from model import GPT, GPTConfig  # nanoGPT's own model.py, from the user's checkout

    ckpt = torch.load(checkpoint, map_location="cpu", weights_only=True)
    model = GPT(GPTConfig(**ckpt["model_args"]))
    model.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in ckpt["model"].items()})
    model.eval()
    stoi = nanogpt_stoi()  # the ids prepare_nanogpt_data wrote (no unpickling of its meta.pkl)
    x, y = windows([stoi[c] for c in val])
    return heldout_loss(lambda xb: model(xb, xb)[0], x, y)  # with targets nanoGPT returns every position's logits


def score_titanloop(checkpoint: str, tokenizer: str, val: str) -> float:
    from titanloop.data.tokenizer import load_tokenizer
    from titanloop.eval import load_model

    model = load_model(checkpoint, device="cpu", dtype="float32")
    x, y = windows(load_tokenizer(tokenizer).encode(val, add_special_tokens=False).ids)
    return heldout_loss(lambda xb: model.lm_head(model(xb, 1).readouts[-1]), x, y)


def op_profile(args, tokenizer: str) -> dict:
    """Where a step's CPU time goes, for both models' forward + backward at the benchmark's shape (one step's batch,
    torch.profiler, --threads): ATen calls per step and self CPU ms in matmuls, attention and everything else."""
    import torch
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile

    from titanloop.model.init import materialize
    from titanloop.train.config import load_config

    sys.path.insert(0, str(Path(args.nanogpt).resolve()))
    from model import GPT, GPTConfig  # nanoGPT's own model.py

    torch.manual_seed(0)
    cfg = load_config(ROOT / CONFIG, ["--data.tokenizer", tokenizer], world_size=1)
    looplm = cfg.family.build()  # on the meta device
    materialize(looplm, "cpu")
    gpt = GPT(GPTConfig(block_size=BLOCK, vocab_size=65, n_layer=4, n_head=4, n_embd=128, dropout=0.0, bias=False))
    ids = torch.randint(0, 65, (BATCH, BLOCK + 1))
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    steps = {
        "titanloop": lambda: F.cross_entropy(
            looplm.lm_head(looplm(x, 1).readouts[-1]).flatten(0, 1), y.flatten()
        ).backward(),
        "nanogpt": lambda: gpt(x, y)[1].backward(),
    }
    out = {}
    for name, step in steps.items():
        for _ in range(5):
            step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(10):
                step()
        events = prof.key_averages()
        ms = {kind: 0.0 for kind in (*OP_KINDS, "other")}
        for e in events:
            ms[op_kind(e.key)] += e.self_cpu_time_total / 10 / 1000
        out[name] = {"aten_calls": round(sum(e.count for e in events) / 10)}
        out[name].update({f"{kind}_ms": round(v, 2) for kind, v in ms.items()})
    return out


# The kinds of ATen op a profiled step's CPU time is split into (everything else is "other").
OP_KINDS = {
    "matmul": lambda op: op in ("aten::mm", "aten::addmm", "aten::bmm"),
    "attention": lambda op: "scaled_dot_product" in op,
}


def op_kind(op: str) -> str:
    """The OP_KINDS kind of ATen op `op` (first match), else "other"."""
    return next((kind for kind, match in OP_KINDS.items() if match(op)), "other")


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    from benchmarks.common import machine, write_report
    from data_pipelines.corpora import build

    torch.set_num_threads(args.threads)
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    corpus = build("shakespeare_char")
    prepare_nanogpt_data(work / "nanogpt")
    _, val = corpus_text()
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(ROOT), "WANDB_MODE": "offline"}
    runs = []
    for i in range(args.runs):
        order = WHO if i % 2 == 0 else WHO[::-1]
        row = {"run": i, "order": "/".join(order)}
        for who in order:
            print(f"[nanogpt bench] run {i + 1}/{args.runs}: training {who}", file=sys.stderr, flush=True)
            if who == "nanogpt":
                r = run_nanogpt(args, work / "nanogpt", i, env)
            else:
                r = run_titanloop(args, work, i, env, compiled=who == "titanloop_compile")
            row[who] = {
                "wall_s": r["wall_s"],
                "tokens_per_s": BATCH * BLOCK * 1000 / statistics.median(r["step_ms"]),
                "heldout": score_nanogpt(args, r["checkpoint"], val)
                if who == "nanogpt"
                else score_titanloop(r["checkpoint"], corpus["tokenizer"], val),
            }
            print(f"[nanogpt bench]   {who}: {json.dumps(row[who])}", file=sys.stderr, flush=True)
        runs.append(row)
    result = summarize(args, runs)
    ops = op_profile(args, corpus["tokenizer"])
    result["tables"].append(
        {
            "title": "Forward + backward of one step, profiled (torch.profiler, the same threads): ATen calls and self "
            "CPU ms",
            "columns": ["model", "ATen calls", "matmul ms", "attention ms", "other ms"],
            "rows": [[k, v["aten_calls"], v["matmul_ms"], v["attention_ms"], v["other_ms"]] for k, v in ops.items()],
        }
    )
    result["result"]["op_profile"] = ops
    print(json.dumps(result["summary"], indent=1))
    if args.out:
        report = {
            "title": "Real text: titanloop beside nanoGPT on tinyshakespeare (CPU)",
            "command": "python benchmarks/nanogpt.py --nanogpt <nanoGPT checkout>"
            + (f" --runs {args.runs}" if args.runs != 3 else "")
            + f" --out {args.out}",
            "machine": machine(),
            **result,
        }
        write_report(args.out, "nanogpt", report)
    return result


def summarize(args, runs: list[dict]) -> dict:
    from benchmarks.common import spread

    def col(who, key):
        return [r[who][key] for r in runs]

    loss_gap = statistics.mean(col("titanloop", "heldout")) - statistics.mean(col("nanogpt", "heldout"))
    ratios = [r["titanloop"]["tokens_per_s"] / r["nanogpt"]["tokens_per_s"] for r in runs]
    compiled = [r["titanloop_compile"]["tokens_per_s"] / r["nanogpt"]["tokens_per_s"] for r in runs]
    wall = [r["nanogpt"]["wall_s"] / r["titanloop"]["wall_s"] for r in runs]
    wall_c = [r["nanogpt"]["wall_s"] / r["titanloop_compile"]["wall_s"] for r in runs]
    summary = [
        {
            "row": "held-out loss, titanloop - nanoGPT (whole validation split, mean over runs)",
            "measured": round(loss_gap, 4),
            "target": "<= 0",
            "met": loss_gap <= 0,
        },
        {
            "row": "training tokens/s, titanloop / nanoGPT (median step, median over runs)",
            "measured": round(statistics.median(ratios), 3),
            "target": ">= 1.0",
            "met": statistics.median(ratios) >= 1.0,
        },
        {
            "row": "training tokens/s, titanloop compiled / nanoGPT (median step, median over runs)",
            "measured": round(statistics.median(compiled), 3),
            "target": None,
            "met": None,
        },
        {
            "row": "wall time from start to exit, nanoGPT / titanloop (median over runs; compiled: "
            f"{statistics.median(wall_c):.3f})",
            "measured": round(statistics.median(wall), 3),
            "target": None,
            "met": None,
        },
    ]
    table = {
        "title": f"Per run ({args.steps} steps of 12 x 64 characters each; {args.threads} CPU threads)",
        "columns": [
            "run",
            "order",
            "nanoGPT held-out",
            "titanloop held-out",
            "nanoGPT tokens/s",
            "titanloop tokens/s",
            "tokens/s ratio",
            "compiled tokens/s",
            "compiled held-out",
            "nanoGPT wall s",
            "titanloop wall s",
            "compiled wall s",
        ],
        "rows": [
            [
                r["run"],
                r["order"],
                round(r["nanogpt"]["heldout"], 4),
                round(r["titanloop"]["heldout"], 4),
                round(r["nanogpt"]["tokens_per_s"]),
                round(r["titanloop"]["tokens_per_s"]),
                round(q, 3),
                round(r["titanloop_compile"]["tokens_per_s"]),
                round(r["titanloop_compile"]["heldout"], 4),
                round(r["nanogpt"]["wall_s"], 1),
                round(r["titanloop"]["wall_s"], 1),
                round(r["titanloop_compile"]["wall_s"], 1),
            ]
            for r, q in zip(runs, ratios)
        ],
    }
    tl = col("titanloop", "heldout")
    notes = [
        f"titanloop held-out loss over seeds 0..{len(runs) - 1}: {spread_line(tl)}; nanoGPT (its fixed seed): "
        f"{spread_line(col('nanogpt', 'heldout'))}. nanoGPT's README gives 1.88 for this command (its own estimate: "
        "20 random validation batches)."
    ]
    return {"summary": summary, "tables": [table], "notes": notes, "result": {"runs": runs, "spread": spread(ratios)}}


def spread_line(values: list[float]) -> str:
    return f"min {min(values):.4f} / median {statistics.median(values):.4f} / max {max(values):.4f}"


if __name__ == "__main__":
    main()
