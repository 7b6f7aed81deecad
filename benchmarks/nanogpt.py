"""titanloop beside nanoGPT on nanoGPT's own CPU example: tinyshakespeare, character level, the "baby GPT" shape.

    python benchmarks/nanogpt.py --nanogpt ~/src/nanoGPT [--runs 3] [--out benchmarks/results/<date>-cpu-nanogpt.json]

nanoGPT comes from the user's checkout (`git clone https://github.com/karpathy/nanoGPT`; its commit, read from the
checkout's .git, goes into the record); nothing of it is edited or copied: its train.py runs as published through
benchmarks/nanogpt_step_profile.py, which times the parts of its loop from outside, from a work directory that holds
its data files, and its model.py is imported to score its checkpoint. Each run trains every row on the same machine,
one after the other (the order alternates from run to run, so load hits all alike), with the same threads (every
core, OMP_NUM_THREADS):

  nanogpt            `train.py config/train_shakespeare_char.py` with the published CPU flags (PROVENANCE:
                     --device=cpu --compile=False --eval_iters=20 --log_interval=1 --block_size=64 --batch_size=12
                     --n_layer=4 --n_head=4 --n_embd=128 --max_iters=2000 --lr_decay_iters=2000 --dropout=0.0), plus
                     --always_save_checkpoint=True (so the step-2000 model is kept) and its --out_dir (and
                     --eval_interval=steps when --steps is no multiple of its 250); its data as its prepare.py writes
                     it (train.bin, val.bin: the characters' ids as uint16; meta.pkl), from the same text and split.
                     Seed 1337 + run (train.py fixes 1337 and has no option: the wrapper offsets torch.manual_seed).
  titanloop          `python -m titanloop.train --config train_configs/nanogpt_shakespeare_char.toml` (one process,
                     no launcher; the same shape, schedule and batch; data from `python -m data_pipelines.corpora
                     shakespeare_char`), with --training.seed / --data.seed = the run's index and
                     --metrics.step_profile true --metrics.log_freq 1 (a profiled, logged step each step, as nanoGPT
                     logs each iteration).
  titanloop_plain    the same at T = 1 in its plainest form: --model.block_norm pre (no sandwich norms), final_only
                     (the config's), so the stack's cost shows apart from the architecture's (the exit gate stays).
  titanloop_compile  the same with --parallelism.compile true (its decoder layers through torch.compile's inductor);
                     its wall time includes the compile (inductor's on-disk cache is warm after the first run).

`--trainers` picks rows (default all). Held-out loss: every final checkpoint is scored here the same way, on the whole
validation split (the last 10% of the characters, 111,540): consecutive windows of 64 characters, each predicting
its 64 next characters, the mean cross-entropy over all 111,488 targets (its time is `score_s`). Speed, over the
same scope for both: every iteration is timed whole, evaluations, checkpoints, logging and callbacks included
(titanloop: the `wall_s` rows of <run_dir>/step_profile.jsonl; nanoGPT: the wrapper's rows, the scope of its own
printed per-iteration time); tokens/s (768 tokens a step) from the median step, every step's time in `step_ms`, and
the mean time per step of each part of the whole-step profile. The wall time of each process from start to exit
splits into start-up (to the first step's start: titanloop's start-up row; nanoGPT: the process's age there, from
/proc), the steps (the last one holds the final evaluation and checkpoint, `final_eval_s`) and the exit.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shlex
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
WHO = ["nanogpt", "titanloop", "titanloop_plain", "titanloop_compile"]  # even runs' order (odd runs: reversed)
TITANLOOP_VARIANTS = {
    "titanloop": [],
    "titanloop_plain": ["--model.block_norm", "pre"],  # the config's T = 1 and final_only, pre-norm blocks
    "titanloop_compile": ["--parallelism.compile", "true"],
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python benchmarks/nanogpt.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--nanogpt", required=True, help="a checkout of karpathy/nanoGPT (holds train.py, model.py)")
    p.add_argument("--runs", type=int, default=3, help="runs of each (default 3); titanloop seeds 0..runs-1")
    p.add_argument("--steps", type=int, default=2000, help="training steps of both (default 2000, as published)")
    p.add_argument(
        "--trainers",
        default=",".join(WHO),
        help=f"comma-separated rows to train (default all: {','.join(WHO)}); the ratios need nanogpt",
    )
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
    args.trainers = [w.strip() for w in args.trainers.split(",") if w.strip()]
    unknown = [w for w in args.trainers if w not in WHO]
    if unknown or not args.trainers:
        p.error(f"--trainers {unknown[0] if unknown else '(none)'}: expected some of {','.join(WHO)}")
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


def git_commit(checkout: Path) -> str | None:
    """The commit a git checkout has checked out, read from its .git (HEAD, the ref's file or packed-refs; a
    worktree's `.git` file is followed) without the git binary; None when it cannot be read."""
    git = checkout / ".git"
    try:
        if git.is_file():  # a worktree or submodule: "gitdir: <path>"
            git = (checkout / git.read_text().split(":", 1)[1].strip()).resolve()
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref: "):
            return head  # a detached HEAD holds the hash
        ref = head[5:]
        common = git / "commondir"  # a worktree's refs live in the main repository
        roots = [git] + ([(git / common.read_text().strip()).resolve()] if common.is_file() else [])
        for root in roots:
            if (root / ref).is_file():
                return (root / ref).read_text().strip()
            if (root / "packed-refs").is_file():
                for line in (root / "packed-refs").read_text().splitlines():
                    if line.endswith(" " + ref):
                        return line.split()[0]
    except (OSError, IndexError):
        return None
    return None


def _profile_rows(path: Path) -> tuple[dict, list[dict]]:
    """A step_profile.jsonl: its start-up row and its per-step rows."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    startup = next((r["startup"] for r in rows if "startup" in r), {})
    return startup, [r for r in rows if "step" in r]


def _run_times(wall: float, startup_s: float, steps: list[dict], final_eval_s: float) -> dict:
    """The process's time split into start-up (to the first step's start), the steps (the last one's final
    evaluation apart) and the exit after the last step."""
    stepped = sum(r["wall_s"] for r in steps)
    return {
        "wall_s": wall,
        "startup_s": startup_s,
        "steps_s": stepped,
        "final_eval_s": final_eval_s,
        "exit_s": wall - startup_s - stepped,
        "step_ms": [round(1000 * r["wall_s"], 3) for r in steps],
        "profile_ms": mean_parts(steps),
    }


def mean_parts(steps: list[dict]) -> dict:
    """Mean ms per step of every part of the whole-step profile (and of what no part covers), over all steps."""
    names = [k for r in steps for k in r["parts"]]
    names = list(dict.fromkeys(names))
    out = {k: 1000 * statistics.fmean(r["parts"].get(k, 0.0) for r in steps) for k in names}
    out["uncovered"] = 1000 * statistics.fmean(r["wall_s"] - sum(r["parts"].values()) for r in steps)
    out["wall"] = 1000 * statistics.fmean(r["wall_s"] for r in steps)
    return {k: round(v, 3) for k, v in out.items()}


def nanogpt_command(args, work: Path, i: int) -> tuple[list[str], Path]:
    d = Path(args.nanogpt).resolve()
    out_dir = work / f"out-{i}"
    flags = [f if not f.startswith("--max_iters=") else f"--max_iters={args.steps}" for f in NANOGPT_FLAGS]
    flags = [f if not f.startswith("--lr_decay_iters=") else f"--lr_decay_iters={args.steps}" for f in flags]
    cmd = [sys.executable, str(ROOT / "benchmarks" / "nanogpt_step_profile.py"), str(work / f"profile-{i}.jsonl")]
    cmd += [str(i), str(d / "train.py"), str(d / "config/train_shakespeare_char.py"), *flags]
    cmd += ["--always_save_checkpoint=True", f"--out_dir={out_dir}"]
    if args.steps % 250:  # it saves at its evaluations (every 250 iterations): evaluate at the last one too
        cmd.append(f"--eval_interval={args.steps}")
    return cmd, out_dir


def run_nanogpt(args, work: Path, i: int, env: dict) -> dict:
    link = work / "configurator.py"  # train.py reads configurator.py from its working directory
    if not link.exists():
        link.symlink_to(Path(args.nanogpt).resolve() / "configurator.py")
    cmd, out_dir = nanogpt_command(args, work, i)
    wall = _timed(cmd, work, env, work / f"nanogpt-{i}.log")
    startup, steps = _profile_rows(work / f"profile-{i}.jsonl")
    last = steps[-1]["parts"]  # its evaluation and checkpoint at the last iteration's start
    out = _run_times(wall, startup.get("process") or 0.0, steps, last["eval"] + last["checkpoint"])
    return {**out, "seed": 1337 + i, "command": shell_line(cmd), "checkpoint": str(out_dir / "ckpt.pt")}


def titanloop_command(args, run_dir: Path, i: int, who: str) -> list[str]:
    cmd = [sys.executable, "-m", "titanloop.train"]  # one process: no torchrun in front (docs/training.md)
    cmd += ["--config", CONFIG, "--training.run_dir", str(run_dir), "--training.steps", str(args.steps)]
    cmd += ["--training.seed", str(i), "--data.seed", str(i), "--metrics.log_freq", "1"]
    cmd += ["--metrics.breakdown", "false", "--metrics.step_profile", "true"]
    cmd += ["--checkpoint.interval", str(args.steps)]
    cmd += TITANLOOP_VARIANTS[who]
    return cmd


def run_titanloop(args, work: Path, i: int, env: dict, who: str = "titanloop") -> dict:
    run_dir = work / f"{who.replace('_', '-')}-{i}"
    if run_dir.exists():
        raise SystemExit(f"error: {run_dir} exists: choose a new --work directory")
    cmd = titanloop_command(args, run_dir, i, who)
    wall = _timed(cmd, ROOT, env, run_dir.with_suffix(".log"))
    startup, steps = _profile_rows(run_dir / "step_profile.jsonl")
    startup_s = sum(v for v in startup.values() if v is not None)
    cbs = steps[-1].get("callbacks", {})  # the last step's held-out scoring and checkpoint
    out = _run_times(
        wall, startup_s, steps, cbs.get("post_step/Validation", 0.0) + cbs.get("post_step/Checkpointing", 0.0)
    )
    out["startup_parts"] = startup
    return {**out, "seed": i, "command": shell_line(cmd), "checkpoint": str(run_dir / "checkpoints")}


def shell_line(cmd: list[str]) -> str:
    """A command as one shell line, with this machine's interpreter and checkout shown as placeholders."""
    line = " ".join(shlex.quote(c) for c in cmd)
    return line.replace(sys.executable, "python").replace(str(ROOT) + "/", "")


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
    looplms = {}
    for who in ("titanloop", "titanloop_plain"):
        cfg = load_config(ROOT / CONFIG, ["--data.tokenizer", tokenizer, *TITANLOOP_VARIANTS[who]], world_size=1)
        looplms[who] = cfg.family.build()  # on the meta device
        materialize(looplms[who], "cpu")
    gpt = GPT(GPTConfig(block_size=BLOCK, vocab_size=65, n_layer=4, n_head=4, n_embd=128, dropout=0.0, bias=False))
    ids = torch.randint(0, 65, (BATCH, BLOCK + 1))
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()

    def looplm_step(m):
        return lambda: F.cross_entropy(m.lm_head(m(x, 1).readouts[-1]).flatten(0, 1), y.flatten()).backward()

    steps = {who: looplm_step(m) for who, m in looplms.items()}
    steps["nanogpt"] = lambda: gpt(x, y)[1].backward()
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
    who_all = [w for w in WHO if w in args.trainers]
    runs = []
    for i in range(args.runs):
        order = who_all if i % 2 == 0 else who_all[::-1]
        row = {"run": i, "order": "/".join(order)}
        for who in order:
            print(f"[nanogpt bench] run {i + 1}/{args.runs}: training {who}", file=sys.stderr, flush=True)
            if who == "nanogpt":
                r = run_nanogpt(args, work / "nanogpt", i, env)
            else:
                r = run_titanloop(args, work, i, env, who)
            started = time.perf_counter()
            r["heldout"] = (
                score_nanogpt(args, r["checkpoint"], val)
                if who == "nanogpt"
                else score_titanloop(r["checkpoint"], corpus["tokenizer"], val)
            )
            r["score_s"] = time.perf_counter() - started
            r["tokens_per_s"] = BATCH * BLOCK * 1000 / statistics.median(r["step_ms"])
            row[who] = {k: v for k, v in r.items() if k != "checkpoint"}
            brief = {k: r[k] for k in ("wall_s", "startup_s", "tokens_per_s", "heldout")}
            print(f"[nanogpt bench]   {who}: {json.dumps(brief)}", file=sys.stderr, flush=True)
        runs.append(row)
    result = summarize(args, runs)
    result["result"]["nanogpt_commit"] = git_commit(Path(args.nanogpt).resolve())
    result["notes"].insert(0, provenance_note(result["result"]["nanogpt_commit"], runs))
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
            + (f" --steps {args.steps}" if args.steps != 2000 else "")
            + (f" --trainers {','.join(args.trainers)}" if set(args.trainers) != set(WHO) else "")
            + f" --out {args.out}",
            "machine": machine(),
            **result,
        }
        write_report(args.out, "nanogpt", without_machine_paths(report, args, work))
    return result


def without_machine_paths(report: dict, args, work: Path) -> dict:
    """The record with this machine's paths in its commands written as placeholders: the work directory as <work>,
    the nanoGPT checkout as <nanoGPT checkout>, this interpreter as python, the repository root as nothing."""
    text = json.dumps(report)
    for path, name in sorted(
        [(str(work), "<work>"), (str(Path(args.nanogpt).resolve()), "<nanoGPT checkout>"), (sys.executable, "python")],
        key=lambda pair: -len(pair[0]),
    ):
        text = text.replace(json.dumps(path)[1:-1], name)
    return json.loads(text.replace(json.dumps(str(ROOT) + "/")[1:-1], ""))


def provenance_note(commit: str | None, runs: list[dict]) -> str:
    """Which nanoGPT, which seeds and which exact commands (run 0's; the others differ in seed and paths)."""
    first = runs[0]
    seeds = {who: [r[who]["seed"] for r in runs] for who in WHO if who in first}
    cmds = "; ".join(f"{who}: `{first[who]['command']}`" for who in WHO if who in first)
    return (
        f"nanoGPT at commit {commit or 'unknown (no readable .git in the checkout)'}, run through "
        "benchmarks/nanogpt_step_profile.py (its train.py as published, its parts timed from outside). Seeds per "
        f"run: {json.dumps(seeds)} (nanoGPT's 1337 + run: its train.py fixes 1337 and has no option, so the wrapper "
        f"offsets torch.manual_seed). Commands of run 0: {cmds}."
    )


TRAIN_CHARACTERS = 1003854  # the training split (the first 90% of tinyshakespeare), nanoGPT's train.bin


def fairness_note(steps: int, plain_row: bool = True) -> str:
    """What differs between the two besides the training stack (the data order, the architecture, the steps)."""
    plain = (
        "; the `titanloop_plain` row (pre-norm blocks, T = 1, final_only; its exit gate is still computed) takes "
        "part of the architecture out"
        if plain_row
        else ""
    )
    tokens, rows, per_pass = steps * BATCH * BLOCK, steps * BATCH, TRAIN_CHARACTERS // BLOCK
    return (
        "What differs besides the trainer: nanoGPT draws each sequence at a uniformly random offset of the training "
        "split (windows overlap; some text is seen more often than other), titanloop reads shuffled non-overlapping "
        f"windows ({BLOCK} inputs each, {per_pass:,} per pass over the {TRAIN_CHARACTERS:,}-character split): "
        f"{steps:,} steps x {BATCH} = {rows:,} windows, {tokens:,} tokens, {rows / per_pass:.2f} passes. "
        "The architectures differ too: titanloop's LoopLM has RoPE, a SwiGLU MLP, RMSNorm sandwich norms around "
        "both sublayers and an exit gate; nanoGPT has learned positions, a GELU MLP, pre-norm LayerNorm and "
        "dropout 0.0 (as in its CPU command). The held-out gap is therefore not the "
        f"training stack's alone{plain}. nanoGPT's train.py runs iterations 0..steps (one more "
        "optimizer step than titanloop; the checkpoint scored is the one it saves after `steps` steps)."
    )


def summarize(args, runs: list[dict]) -> dict:
    from benchmarks.common import spread

    present = [w for w in WHO if w in runs[0]]

    def col(who, key):
        return [r[who][key] for r in runs]

    def ratio_row(who, what):
        q = [r[who]["tokens_per_s"] / r["nanogpt"]["tokens_per_s"] for r in runs]
        return q, {
            "row": f"training tokens/s, {what} / nanoGPT (median step, median over runs)",
            "measured": round(statistics.median(q), 3),
            "target": ">= 1.0" if who == "titanloop" else None,
            "met": statistics.median(q) >= 1.0 if who == "titanloop" else None,
        }

    summary, ratios = [], {}
    if "nanogpt" in present and "titanloop" in present:
        loss_gap = statistics.mean(col("titanloop", "heldout")) - statistics.mean(col("nanogpt", "heldout"))
        summary.append(
            {
                "row": "held-out loss, titanloop - nanoGPT (whole validation split, mean over runs)",
                "measured": round(loss_gap, 4),
                "target": "<= 0",
                "met": loss_gap <= 0,
            }
        )
    if "nanogpt" in present:
        names = {
            "titanloop": "titanloop",
            "titanloop_plain": "titanloop plain",
            "titanloop_compile": "titanloop compiled",
        }
        for who in present[1:]:
            ratios[who], row = ratio_row(who, names[who])
            summary.append(row)
        if "titanloop" in present:
            wall = [r["nanogpt"]["wall_s"] / r["titanloop"]["wall_s"] for r in runs]
            others = ", ".join(
                f"{names[w]}: {statistics.median(r['nanogpt']['wall_s'] / r[w]['wall_s'] for r in runs):.3f}"
                for w in present[2:]
            )
            summary.append(
                {
                    "row": "wall time from start to exit, nanoGPT / titanloop (median over runs"
                    + (f"; {others})" if others else ")"),
                    "measured": round(statistics.median(wall), 3),
                    "target": None,
                    "met": None,
                }
            )
    table = {
        "title": f"Per run ({args.steps} steps of 12 x 64 characters each; {args.threads} CPU threads): held-out "
        "loss, tokens/s of the median step, wall s from start to exit = start-up + steps + exit",
        "columns": ["run", "trainer", "seed", "held-out", "tokens/s", "wall s", "start-up s", "steps s", "exit s"],
        "rows": [
            [
                r["run"],
                w,
                r[w]["seed"],
                round(r[w]["heldout"], 4),
                round(r[w]["tokens_per_s"]),
                round(r[w]["wall_s"], 1),
                round(r[w]["startup_s"], 2),
                round(r[w]["steps_s"], 1),
                round(r[w]["exit_s"], 2),
            ]
            for r in runs
            for w in present
        ],
    }
    profile = {
        "title": "Where a step goes (whole-step profile of every step, the same scope for both: the whole iteration "
        "with evaluations, logging and callbacks): mean ms per step over all steps and runs, and the last step's "
        "final evaluation + checkpoint, the benchmark's own held-out scoring after the run (s, median over runs)",
        "columns": ["trainer", "part", "ms per step", "share of step"],
        "rows": [],
    }
    for w in present:
        parts = {k: statistics.fmean(r[w]["profile_ms"].get(k, 0.0) for r in runs) for k in runs[0][w]["profile_ms"]}
        wall = parts.pop("wall")
        for k, v in parts.items():
            if v > 0.0005 or k == "uncovered":
                profile["rows"].append([w, k, round(v, 2), f"{100 * v / wall:.1f}%"])
        profile["rows"].append([w, "step (mean)", round(wall, 2), "100%"])
        for k in ("final_eval_s", "score_s"):
            profile["rows"].append([w, k.removesuffix("_s") + " (s)", round(statistics.median(col(w, k)), 2), ""])
    notes = []
    if "titanloop" in present and "nanogpt" in present:
        notes.append(
            f"titanloop held-out loss over seeds {', '.join(str(s) for s in col('titanloop', 'seed'))}: "
            f"{spread_line(col('titanloop', 'heldout'))}; nanoGPT over seeds "
            f"{', '.join(str(s) for s in col('nanogpt', 'seed'))}: {spread_line(col('nanogpt', 'heldout'))}. "
            "nanoGPT's README gives 1.88 for this command (its own estimate: 20 random validation batches)."
        )
    notes.append(fairness_note(args.steps))
    first = ratios.get("titanloop") or [1.0]
    return {
        "summary": summary,
        "tables": [table, profile],
        "notes": notes,
        "result": {"trainers": present, "runs": runs, "spread": spread(first)},
    }


def spread_line(values: list[float]) -> str:
    return f"min {min(values):.4f} / median {statistics.median(values):.4f} / max {max(values):.4f}"


if __name__ == "__main__":
    main()
