"""Depth that holds at test time: does a looped LM's held-out loss hold (or fall) when it runs more loops than it
was trained at?

    python -m experiments.depth --part tune                            # arms on a tuning split, seed 0
    python -m experiments.depth --part record --seeds 1,2,3            # the chosen recipe, both corpora
    python -m experiments.depth --part tune --only recipe,shared       # some arms only
    python -m experiments.depth --part record --arm nanochat --corpora wikitext2_char --seeds 1,2,3

Tuning (`--part tune`): tinyshakespeare seed 0, scored on a split carved from the TRAINING text (its first 90% of
characters: the first 90% of those train, the rest is the tuning split), never on the held-out split that is
reported. Each arm is the real-text recipe (train_configs/shakespeare_looped.toml: one shared layer, 2,000 steps of
12 x 64 characters) with the depth tools of docs/training.md ("Depth that holds") changed; each scores the tuning
split at T = 1..64 (log-spaced).

Recording (`--part record`): an arm (`--arm`, default RECIPE below) on tinyshakespeare and WikiText-2 (`--corpora`
picks some) with seeds 1-3, each scored on its corpus's whole held-out split at T = 1..64, beside the same layer run
once and the dense model of 4 layers: their recorded runs of experiments/real_text (recorded/looping.json: the same
configs and seeds; their held-out losses do not depend on depth). It writes record_<arm>.json (a subset of the
corpora: record_<arm>_<corpora>.json).

Goals (set before the runs, not moved after), per seed and corpus: held-out loss at T = 8 and T = 16 no higher than
at the trained depth, T = 32 within 0.01 of it; the gap closed to the dense model at the trained depth at or above
the old recipe's (66% / 54%) within one seed standard deviation; training FLOPs within 10% of the dense model's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from experiments import common

NAME = "depth"
LOOPED = "train_configs/shakespeare_looped.toml"
DENSE = "train_configs/nanogpt_shakespeare_char.toml"
CORPORA = {"shakespeare_char": 67, "wikitext2_char": 139}
LOOPS = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]
SHARED = {"model.per_loop_norm": False, "model.max_loops": 64}  # one map for every loop: defined at any depth
# Huginn-style depth sampling with truncated backpropagation: T = Poisson(rate) + 1, rate ~ LogNormal with mean m;
# k loops with a graph. Forward FLOPs ~ E[T], backward ~ 2 k: E[T] + 2k ~ 12 (the dense model's 4 + 8)
DEPTH = {
    "loop_sampler.kind": "poisson_lognormal",
    "loop_sampler.mean": 5.0,
    "loop_sampler.sigma": 0.5,
    "loop_sampler.min_sampled": 1,
    "loop_sampler.max_sampled": 32,
    "loop_sampler.backprop_loops": 3,
    "loop_sampler.n_loops": 6,
}
DEEP = {**DEPTH, "loop_sampler.mean": 8.0, "loop_sampler.max_sampled": 64, "loop_sampler.backprop_loops": 2}
DEEP["loop_sampler.n_loops"] = 9
# looped_nanochat's: mean 4 (E[T] = 5), at most 16, the last 4 loops backpropagated (E[T] + 2 E[min(T, 4)] ~ 12):
# most steps keep every loop's graph, unlike DEPTH's 3 of ~6
NANOCHAT = {
    **DEPTH,
    "loop_sampler.mean": 4.0,
    "loop_sampler.max_sampled": 16,
    "loop_sampler.backprop_loops": 4,
    "loop_sampler.n_loops": 5,
}
DENSE_CE = {"objective.name": "dense", "objective.dense_schedule": "uniform"}  # CE of every loop with a graph
ARMS = {  # name -> overrides of the recipe
    "recipe": {"model.max_loops": 64},  # today's recipe (per-loop norms past T = 8 never trained)
    "shared": {**SHARED},
    "depth": {**SHARED, **DEPTH},
    "depth_diag": {**SHARED, **DEPTH, "model.injection": "diagonal"},
    "depth_random": {**SHARED, **DEPTH, "model.init_state": "random"},
    "depth_ramp": {**SHARED, **DEPTH, "loop_sampler.mean_start": 1.0, "loop_sampler.mean_ramp_fraction": 0.5},
    # deeper: mean 8 with 2 loops backpropagated (E[T] + 2k ~ 13), from a random state (Huginn)
    "deep": {**SHARED, **DEEP, "model.init_state": "random"},
    "deep_dense": {**SHARED, **DEEP, "model.init_state": "random", **DENSE_CE},
    "nanochat": {**SHARED, **NANOCHAT},
    "nanochat_ramp": {**SHARED, **NANOCHAT, "loop_sampler.mean_start": 1.0, "loop_sampler.mean_ramp_fraction": 0.5},
    # the same with a learned recurrence gate, h <- g h_new + (1 - g) x (g = sigmoid(W [h_new; x] + b), 12% at
    # init): the update can learn to shrink where the state has settled, a fixed point the extra loops keep
    "nanochat_ramp_gated": {
        **SHARED,
        **NANOCHAT,
        "loop_sampler.mean_start": 1.0,
        "loop_sampler.mean_ramp_fraction": 0.5,
        "model.gated_recurrence": True,
    },
    # the same with the fixed-point penalty: one more loop after the last, its relative change to the state
    # penalized (objective.fixed_point_weight), so that the map holds the state where the loss is taken
    "nanochat_ramp_fixed": {
        **SHARED,
        **NANOCHAT,
        "loop_sampler.mean_start": 1.0,
        "loop_sampler.mean_ramp_fraction": 0.5,
        "objective.fixed_point_weight": 1.0,
    },
    "nanochat_ramp_fixed10": {
        **SHARED,
        **NANOCHAT,
        "loop_sampler.mean_start": 1.0,
        "loop_sampler.mean_ramp_fraction": 0.5,
        "objective.fixed_point_weight": 10.0,
    },
    # the same without truncation (every sampled loop backpropagated): what truncation costs
    "nanochat_full": {
        **SHARED,
        **NANOCHAT,
        "loop_sampler.mean_start": 1.0,
        "loop_sampler.mean_ramp_fraction": 0.5,
        "loop_sampler.backprop_loops": 0,
    },
}
RECIPE = "depth"


def run_overrides(seed: int, smoke: bool, data: dict) -> dict:
    steps = 6 if smoke else 2000
    return {
        **data,
        "training.seed": seed,
        "data.seed": seed,
        "training.steps": steps,
        "validation.steps": 1 if smoke else 0,  # smoke: one held-out batch; else the whole split
        "validation.freq": steps,
        "validation.loops": LOOPS,
        "metrics.log_freq": 500 if not smoke else 1,
    }


def corpus_data(corpus: str, val: str | None = None, train: str | None = None) -> dict:
    d = common.REPO / "data" / "shards" / corpus
    tok = str(d / "tokenizer.json")
    return {
        "model.vocab_size": CORPORA[corpus],
        "data.tokenizer": tok,
        "data.sources": [{"path": train or str(d / "train")}],
        "validation.data": {"kind": "mds", "tokenizer": tok, "sources": [{"path": val or str(d / "val")}]},
    }


def tuning_split(out: Path) -> dict:
    """tinyshakespeare's training text (its first 90% of characters) split again 90/10 with the same tokenizer."""
    from data_pipelines import tokenize
    from data_pipelines.corpora import DATA

    root = out / "tuning_split"
    if (root / "val" / "manifest.json").is_file():
        return corpus_data("shakespeare_char", val=str(root / "val"), train=str(root / "train"))
    text = (Path(DATA) / "tinyshakespeare.txt").read_text()
    root.mkdir(parents=True, exist_ok=True)
    src = root / "text" / "train90.txt"
    src.parent.mkdir(exist_ok=True)
    src.write_text(text[: int(0.9 * len(text))])
    tok = str(common.REPO / "data" / "shards" / "shakespeare_char" / "tokenizer.json")
    tokenize.main(
        ["--tokenizer", tok, "--out", str(root / "train"), "--holdout", "0.1", "--holdout-out", str(root / "val")]
        + ["--workers", "1", str(src)]
    )
    return corpus_data("shakespeare_char", val=str(root / "val"), train=str(root / "train"))


def by_t(run_dir: Path) -> list[float]:
    rows = [r for r in common.metrics(run_dir) if "val/loss/loop_1" in r]
    return [rows[-1][f"val/loss/loop_{t}"] for t in LOOPS]


def reference_depth(arm: str) -> int:
    """The arm's trained depth (n_loops: T, or the sampler's mean), or the deepest swept T below it (a sampled mean
    such as 5 is not swept): the depth the loss past it is measured against."""
    t_train = ARMS[arm].get("loop_sampler.n_loops", 4)
    return max(t for t in LOOPS if t <= t_train)


def state_drift(run_dir: Path, data: dict, t_ref: int, rows: int = 256) -> dict:
    """How far the state the LM head decodes (the normed state of each loop) moves with depth, on the first `rows`
    held-out windows, per token, at every swept T: `step`, the relative change made by loop T (||z_T - z_{T-1}|| /
    ||z_{T-1}||), and `from_reference`, the relative distance from the state at the reference depth
    (||z_T - z_ref|| / ||z_ref||). A state that settles into a fixed point has both flat past the reference."""
    import torch

    from titanloop.data import DataConfig
    from titanloop.data.shards import whole_set_batches

    model = common.load(run_dir)
    val = data["validation.data"]
    seq_len = common.run_config(run_dir)["training"]["seq_len"]
    cfg = DataConfig(kind="mds", tokenizer=val["tokenizer"], sources=val["sources"])
    batch = whole_set_batches(cfg, seq_len=seq_len, vocab_size=data["model.vocab_size"], batch_size=rows)[0]
    states = {}
    with torch.no_grad():
        prev = None
        for s in model.loops(batch["input_ids"], LOOPS[-1], doc_ids=batch.get("doc_ids")):
            z = s.normed.float()
            if s.t in LOOPS:
                states[s.t] = (z, prev)
            prev = z

    def rel(a, b):
        return float(f"{((a - b).norm(dim=-1) / b.norm(dim=-1)).mean().item():.4g}")  # small values stay nonzero

    ref = states[t_ref][0]
    return {
        "step": {f"T={t}": rel(z, p) for t, (z, p) in states.items() if p is not None},
        "from_reference": {f"T={t}": rel(z, ref) for t, (z, _) in states.items() if t > t_ref},
    }


def training_flops(config: str, overrides: dict) -> float:
    """Training FLOPs per token of a run, summed over its steps: each step's sampled T counted as it runs (the
    forward of every loop, the backward of the loops with a graph; LoopLMConfig.flops_per_token)."""
    from titanloop.objectives.loop_sampler import LoopSampler
    from titanloop.train.config import load_config

    over = {k: v for k, v in overrides.items() if not k.startswith(("validation.", "data.", "metrics."))}
    cfg = load_config(common.REPO / config, common.override_args(over), world_size=1)
    sampler, s = LoopSampler(cfg.loop_sampler, cfg.training.steps), cfg.loop_sampler
    total = 0.0
    for step in range(1, cfg.training.steps + 1):
        t = sampler(step)
        k = s.graph_loops(t)
        total += cfg.looplm.flops_per_token(
            cfg.training.seq_len,
            n_loops=t,
            backward_loops=k if k < t else None,
            unread_loops=1 if cfg.objective.fixed_point_weight > 0 else 0,  # the fixed-point penalty's extra loop
        )
    return total


def tune(args) -> None:
    data = tuning_split(args.out)
    jobs = [
        (LOOPED, args.out / f"tune_{arm}_s{seed}", {**run_overrides(seed, args.smoke, data), **ARMS[arm]})
        for seed in args.seeds
        for arm in args.only
    ]
    common.train_many(jobs, parallel=args.parallel, **common.run_options(args))
    dense = training_flops(DENSE, run_overrides(0, args.smoke, data))
    rows = []
    for seed in args.seeds:
        for arm in args.only:
            over = {**run_overrides(seed, args.smoke, data), **ARMS[arm]}
            losses = by_t(args.out / f"tune_{arm}_s{seed}")
            rows.append(
                {
                    "arm": arm,
                    "seed": seed,
                    "flops/dense": round(training_flops(LOOPED, over) / dense, 3),
                    **{f"T={t}": round(v, 4) for t, v in zip(LOOPS, losses)},
                    "state_drift": state_drift(args.out / f"tune_{arm}_s{seed}", data, reference_depth(arm)),
                }
            )
    print(common.markdown_table(["arm", "seed", "flops/dense"] + [f"T={t}" for t in LOOPS], rows))
    (args.out / "tuning.json").write_text(json.dumps({"loops": LOOPS, "arms": ARMS, "rows": rows}, indent=1) + "\n")


def record(args) -> None:
    """The chosen arm on both corpora and seeds, beside the recorded once / dense models of experiments.real_text
    (the same configs and seeds; their held-out loss does not depend on depth)."""
    base = json.loads((common.REPO / "experiments/real_text/recorded/looping.json").read_text())
    jobs = [
        (
            LOOPED,
            args.out / f"{corpus}_{args.arm}_s{seed}",
            {**run_overrides(seed, args.smoke, corpus_data(corpus)), **ARMS[args.arm]},
        )
        for corpus in args.corpora
        for seed in args.seeds
    ]
    common.train_many(jobs, parallel=args.parallel, **common.run_options(args))
    dense_flops = training_flops(DENSE, run_overrides(0, args.smoke, corpus_data("shakespeare_char")))
    rows, out = [], {"arm": args.arm, "overrides": ARMS[args.arm], "loops": LOOPS, "seeds": args.seeds, "corpora": {}}
    for corpus in args.corpora:
        rec = base["per_corpus"][corpus]["heldout"]
        seeds_rec = base["seeds"]
        once = [rec["once"][seeds_rec.index(s)][0] for s in args.seeds]
        dense = [rec["dense"][seeds_rec.index(s)][0] for s in args.seeds]
        old4 = [rec["looped"][seeds_rec.index(s)][3] for s in args.seeds]
        looped = [by_t(args.out / f"{corpus}_{args.arm}_s{s}") for s in args.seeds]
        t_train = ARMS[args.arm].get("loop_sampler.n_loops", 4)
        i_train = LOOPS.index(reference_depth(args.arm))
        closed = [(o - lp[i_train]) / (o - d) for lp, o, d in zip(looped, once, dense)]
        best = [min(lp) for lp in looped]
        best_t = [LOOPS[lp.index(min(lp))] for lp in looped]
        for s, lp, c, b, bt in zip(args.seeds, looped, closed, best, best_t):
            rows.append(
                {
                    "corpus": corpus,
                    "seed": s,
                    "gap closed": f"{100 * c:.0f}%",
                    "best T": bt,
                    **{f"T={t}": round(v, 3) for t, v in zip(LOOPS, lp)},
                }
            )
        over = {**run_overrides(args.seeds[0], args.smoke, corpus_data(corpus)), **ARMS[args.arm]}
        out["corpora"][corpus] = {
            "heldout": looped,
            "once_T1_recorded": once,
            "dense_T1_recorded": dense,
            "old_recipe_T4_recorded": old4,
            "t_train": t_train,
            "t_reference": LOOPS[i_train],
            "past_reference": {  # held-out loss at T minus at the reference depth, per seed
                f"T={t}": [lp[LOOPS.index(t)] - lp[i_train] for lp in looped] for t in (8, 16, 32, 64)
            },
            "state_drift": [  # per seed: how far the decoded state moves with depth (state_drift)
                state_drift(args.out / f"{corpus}_{args.arm}_s{s}", corpus_data(corpus), LOOPS[i_train])
                for s in args.seeds
            ],
            "gap_closed": closed,
            "best": best,
            "best_t": best_t,
            "flops_over_dense": training_flops(LOOPED, over) / dense_flops,
        }
    print(common.markdown_table(["corpus", "seed", "gap closed", "best T"] + [f"T={t}" for t in LOOPS], rows))
    part = "" if args.corpora == list(CORPORA) else "_" + "_".join(args.corpora)  # a subset: its own file
    (args.out / f"record_{args.arm}{part}.json").write_text(json.dumps(out, indent=1) + "\n")


def main(argv=None) -> int:
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument(
        "--part",
        choices=("tune", "record"),
        default="tune",
        help="tune: every arm on the tuning split, seed 0; record: one arm on both corpora (default tune)",
    )
    extra.add_argument(
        "--only",
        type=lambda s: s.split(","),
        default=list(ARMS),
        help="--part tune: comma-separated arms (default all)",
    )
    extra.add_argument("--arm", default=RECIPE, help=f"--part record: the arm to record (default {RECIPE})")
    extra.add_argument(
        "--corpora",
        type=lambda s: s.split(","),
        default=list(CORPORA),
        help=f"--part record: comma-separated corpora (default {','.join(CORPORA)})",
    )
    args = common.parse_args(NAME, __doc__.split("\n\n")[0], argv, own=extra)
    for flag, given, known in (
        ("--only", args.only, ARMS),
        ("--arm", [args.arm], ARMS),
        ("--corpora", args.corpora, CORPORA),
    ):
        bad = [a for a in given if a not in known]
        if bad:
            raise SystemExit(f"error: {flag} {bad[0]!r} is unknown: expected some of {', '.join(known)}")
    from data_pipelines.corpora import build

    build("shakespeare_char")
    if args.part == "tune":
        tune(args)
    else:
        for corpus in args.corpora:
            build(corpus)
        record(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
