"""Looping on real text: does one shared layer run T = 4 times close the gap to the dense model of the same FLOPs?
And the seed papers' three directions on real text.

    python -m experiments.real_text --seeds 0,1,2 --parallel 2                 # both parts, both corpora
    python -m experiments.real_text --part looping --corpora shakespeare_char --seeds 0
    python -m experiments.real_text --part directions --only blind_spot --seeds 1,2,3     # retrain one direction

Looping (`--part looping`): on each corpus (tinyshakespeare and WikiText-2, character level, data/README.md), three
models of nanoGPT's CPU "baby GPT" width train on the same 2,000 steps of 12 x 64 characters:
  looped  one shared layer x T = 4, titanloop's real-text recipe (train_configs/shakespeare_looped.toml)
  once    the same layer run once (T = 1)
  dense   4 layers run once (train_configs/nanogpt_shakespeare_char.toml): the looped model's FLOPs, 4x the parameters
Each scores its corpus's whole held-out split at T = 1..8 at its last step (validation.steps = 0). Goal (set before
the runs, not moved after): at the trained T = 4 the looped model closes >= 50% of the held-out-loss gap between
`once` and `dense` (on the mean over seeds, on both corpora), and its loss at T = 8 is no higher than at T = 4.

Directions (`--part directions`, tinyshakespeare):
  readout blind spot (Table 2)  per-loop CE, no inter-loop norm, K = 4: RMSNorm readout vs raw readout vs RMSNorm
                                readout with the scale penalty; the final-loop hidden norm ||H_K||_2 on held-out text
  Ouro Q-exit (§3.2)            a Stage I model (its gate trained by the entropy-regularized objective): held-out loss
                                and average loops of Q-exit beside static exit at T = 1..4
  STARS (§5)                    the recipe (its lognormal loop sampling is STARS'), with and without the Jacobian
                                regularizer (lambda = 0.1): loss past the trained depth (T = 8 minus T = 4)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from experiments import common

NAME = "real_text"
LOOPED = "train_configs/shakespeare_looped.toml"
DENSE = "train_configs/nanogpt_shakespeare_char.toml"
CORPORA = {"shakespeare_char": 67, "wikitext2_char": 139}  # name -> vocabulary (data_pipelines.corpora)
LOOPS = list(range(1, 9))
T_TRAIN = 4
MODELS = {  # name -> (config, overrides)
    "looped": (LOOPED, {}),
    "once": (LOOPED, {"loop_sampler.kind": "fixed", "loop_sampler.n_loops": 1}),
    "dense": (DENSE, {}),
}
# per-loop CE (uniform dense supervision), no inter-loop norm, K = 4, the recipe's other settings
BLIND_SPOT = {
    "perloop_norm": {"model.readout": "norm"},
    "perloop_raw": {"model.readout": "raw"},
    "perloop_norm_penalty": {"model.readout": "norm", "objective.scale_penalty": 0.01},
}
BLIND_BASE = {  # the paper's ablation: no normalization on the recurrent path, so the recipe's per-loop norms go too
    "model.per_loop_norm": False,
    "model.inject_embedding": False,
    "objective.name": "dense",
    "objective.dense_schedule": "uniform",
    "objective.dense_alpha": 3.0,
    "model.inter_loop_norm": False,
    "loop_sampler.kind": "fixed",
    "loop_sampler.n_loops": T_TRAIN,
}
Q_EXIT = {"objective.name": "stage1", "objective.beta": 0.1, "loop_sampler.kind": "fixed", "loop_sampler.n_loops": 4}
Q_GRID = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]
# STARS: the recipe (which samples T from a lognormal, STARS' loop sampling) with and without its Jacobian regularizer;
# the looping part's looped runs are the "off" runs when they are there (the same config and seeds)
STARS = {"stars_off": {}, "stars_on": {"objective.jsrr_weight": 0.1}}
DIRECTIONS = ("blind_spot", "q_exit", "stars")  # --only: which directions train (the others' runs are read as they are)


def data_overrides(corpus: str) -> dict:
    d = f"data/shards/{corpus}"
    held = {"kind": "mds", "tokenizer": f"{d}/tokenizer.json", "sources": [{"path": f"{d}/val"}]}
    return {
        "model.vocab_size": CORPORA[corpus],
        "data.tokenizer": f"{d}/tokenizer.json",
        "data.sources": [{"path": f"{d}/train"}],
        "validation.data": held,
    }


def run_overrides(seed: int, smoke: bool) -> dict:
    steps = 6 if smoke else 2000
    return {
        "training.seed": seed,
        "data.seed": seed,
        "training.steps": steps,
        "validation.steps": 0,
        "validation.freq": steps,
        "validation.loops": LOOPS,
        "metrics.log_freq": 500 if not smoke else 1,
    }


def last_validation(run_dir: Path) -> dict:
    rows = [r for r in common.metrics(run_dir) if "val/loss/loop_1" in r]
    return rows[-1]


def heldout_by_t(run_dir: Path) -> list[float]:
    v = last_validation(run_dir)
    return [v[f"val/loss/loop_{t}"] for t in LOOPS]


def cell(values: list[float]) -> str:
    m, s = common.mean_std(values)
    return f"{m:.3f} ± {s:.3f}"


def looping(args, jobs_only: bool = False):
    corpora = args.corpora
    jobs = []
    for corpus in corpora:
        for seed in args.seeds:
            for model, (config, over) in MODELS.items():
                o = {**data_overrides(corpus), **run_overrides(seed, args.smoke), **over}
                jobs.append((config, args.out / f"{corpus}_{model}_s{seed}", o))
    if jobs_only:
        return jobs
    common.train_many(jobs, args.parallel, **common.run_options(args))
    rows, verdicts, per_corpus = [], [], {}
    for corpus in corpora:
        res = {m: [heldout_by_t(args.out / f"{corpus}_{m}_s{s}") for s in args.seeds] for m in MODELS}
        i4, i1, i8 = LOOPS.index(T_TRAIN), LOOPS.index(1), LOOPS.index(8)
        closed = [(o[i1] - lp[i4]) / (o[i1] - d[i1]) for lp, o, d in zip(res["looped"], res["once"], res["dense"])]
        past = [lp[i8] - lp[i4] for lp in res["looped"]]
        for m in MODELS:
            row = {"corpus": corpus, "model": m}
            row.update({f"T={t}": cell([r[j] for r in res[m]]) for j, t in enumerate(LOOPS)})
            rows.append(row)
        mean = {m: [common.mean_std([r[j] for r in res[m]])[0] for j in range(len(LOOPS))] for m in MODELS}
        gap = (mean["once"][i1] - mean["looped"][i4]) / (mean["once"][i1] - mean["dense"][i1])
        per_corpus[corpus] = {"heldout": res, "gap_closed": closed, "gap_closed_of_means": gap, "t8_minus_t4": past}
        verdicts.append(
            f"{corpus}: the looped model closes {100 * gap:.0f}% of the gap at T = {T_TRAIN} on the means (per seed "
            + ", ".join(f"{100 * c:.0f}%" for c in closed)
            + "); T = 8 minus T = 4: "
            + ", ".join(f"{p:+.3f}" for p in past)
        )
    met = [
        per_corpus[c]["gap_closed_of_means"] >= 0.5 and common.mean_std(per_corpus[c]["t8_minus_t4"])[0] <= 0
        for c in corpora
    ]
    return rows, verdicts, per_corpus, all(met), any(per_corpus[c]["gap_closed_of_means"] >= 0.5 for c in corpora)


def final_norm(run_dir: Path, batches) -> float:
    from experiments.readout_blind_spot.__main__ import final_norm as norm_of

    return norm_of(common.load(run_dir), batches)


def held_out_batches(corpus: str, smoke: bool):
    from titanloop.data import DataConfig
    from titanloop.data.shards import whole_set_batches

    d = f"data/shards/{corpus}"
    cfg = DataConfig(kind="mds", sources=[{"path": str(common.REPO / d / "val")}])
    batches = whole_set_batches(cfg, seq_len=64, vocab_size=CORPORA[corpus], batch_size=256)
    return [{**b, "token_mask": b["labels"] != -100} for b in (batches[:1] if smoke else batches)]


def done(run_dir: Path) -> bool:
    return (run_dir / "metrics.jsonl").is_file() and any("val/loss/loop_1" in r for r in common.metrics(run_dir))


def stars_dir(args, name: str, seed: int) -> Path:
    """The run dir of STARS variant `name`: for "stars_off" the looping part's looped run on tinyshakespeare when
    this output holds it (the same config and seed), else its own."""
    looped = args.out / f"shakespeare_char_looped_s{seed}"
    return looped if name == "stars_off" and done(looped) else args.out / f"{name}_s{seed}"


def directions(args):
    corpus = "shakespeare_char"
    base = {**data_overrides(corpus)}
    jobs = []
    for seed in args.seeds:
        ro = run_overrides(seed, args.smoke)
        if "blind_spot" in args.only:
            for name, over in BLIND_SPOT.items():
                jobs.append((LOOPED, args.out / f"blind_{name}_s{seed}", {**base, **ro, **BLIND_BASE, **over}))
        if "q_exit" in args.only:
            jobs.append((LOOPED, args.out / f"qexit_stage1_s{seed}", {**base, **ro, **Q_EXIT, "validation.q": Q_GRID}))
        for name, over in STARS.items():
            if "stars" in args.only and not (name == "stars_off" and done(stars_dir(args, name, seed))):
                jobs.append((LOOPED, stars_dir(args, name, seed), {**base, **ro, **over}))
    common.train_many(jobs, args.parallel, **common.run_options(args))
    batches = held_out_batches(corpus, args.smoke)
    rows, out = [], {}
    # (each block below reads the runs above: the blind spot's norms on held-out text, Q-exit's and STARS' losses)
    # readout blind spot
    blind = {n: [final_norm(args.out / f"blind_{n}_s{s}", batches) for s in args.seeds] for n in BLIND_SPOT}
    blind_ce = {n: [heldout_by_t(args.out / f"blind_{n}_s{s}")[T_TRAIN - 1] for s in args.seeds] for n in BLIND_SPOT}
    for n in BLIND_SPOT:
        rows.append(
            {
                "direction": "readout blind spot",
                "variant": n,
                "measure": f"||H_K||_2 {cell(blind[n])}",
                "held-out loss": cell(blind_ce[n]),
            }
        )
    ratio = [
        a / max(b, c) for a, b, c in zip(blind["perloop_norm"], blind["perloop_raw"], blind["perloop_norm_penalty"])
    ]
    out["blind_spot"] = {"final_norm": blind, "heldout": blind_ce, "norm_over_max_raw_penalty": ratio}
    # Q-exit vs static exit at the same average loops
    q_rows = []
    for s in args.seeds:
        v = last_validation(args.out / f"qexit_stage1_s{s}")
        static = [v[f"val/loss/loop_{t}"] for t in LOOPS]
        for q in Q_GRID:
            loops_, loss = v[f"val/q_exit/q{q}/avg_loops"], v[f"val/q_exit/q{q}/loss"]
            lo = min(int(math.floor(loops_)), len(LOOPS) - 1)
            frac = loops_ - lo
            interp = (
                static[lo - 1] if frac == 0 or lo >= T_TRAIN else static[lo - 1] + frac * (static[lo] - static[lo - 1])
            )
            q_rows.append({"seed": s, "q": q, "avg_loops": loops_, "loss": loss, "static_at_same_loops": interp})
    better = [r for r in q_rows if r["avg_loops"] < T_TRAIN - 1e-6]
    wins = sum(r["loss"] <= r["static_at_same_loops"] for r in better)
    for q in Q_GRID:
        sel = [r for r in q_rows if r["q"] == q]
        rows.append(
            {
                "direction": "Ouro Q-exit",
                "variant": f"q = {q}",
                "measure": f"avg loops {cell([r['avg_loops'] for r in sel])}",
                "held-out loss": f"{cell([r['loss'] for r in sel])} (static at those loops "
                f"{cell([r['static_at_same_loops'] for r in sel])})",
            }
        )
    out["q_exit"] = {"points": q_rows, "below_static": wins, "of": len(better)}
    # STARS: loss past the trained depth
    stars = {n: [heldout_by_t(stars_dir(args, n, s)) for s in args.seeds] for n in STARS}
    for n in STARS:
        past = [r[LOOPS.index(8)] - r[LOOPS.index(T_TRAIN)] for r in stars[n]]
        rows.append(
            {
                "direction": "STARS",
                "variant": n,
                "measure": f"T=8 - T=4 {cell(past)}",
                "held-out loss": f"T=4 {cell([r[T_TRAIN - 1] for r in stars[n]])}",
            }
        )
    out["stars"] = {n: stars[n] for n in STARS}
    return rows, out


def main(argv=None) -> int:
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument(
        "--part",
        choices=("looping", "directions", "all"),
        default="all",
        help="looping: once / looped / dense on every corpus; directions: the seed papers' directions (default all)",
    )
    extra.add_argument(
        "--corpora",
        type=lambda s: s.split(","),
        default=list(CORPORA),
        help=f"comma-separated corpora (default {','.join(CORPORA)})",
    )
    extra.add_argument(
        "--only",
        type=lambda s: s.split(","),
        default=list(DIRECTIONS),
        help="--part directions: comma-separated directions (default all)",
    )
    args = common.parse_args(NAME, __doc__.split("\n\n")[0], argv, own=extra)
    if set(args.only) - set(DIRECTIONS):
        raise SystemExit(f"error: --only {args.only} is invalid: expected some of {', '.join(DIRECTIONS)}")
    bad = [c for c in args.corpora if c not in CORPORA]
    if bad:
        raise SystemExit(f"error: --corpora {bad[0]!r} is unknown: expected some of {', '.join(CORPORA)}")
    from data_pipelines.corpora import build

    for corpus in set(args.corpora) | ({"shakespeare_char"} if args.part != "looping" else set()):
        build(corpus)
    result = {}
    if args.part in ("looping", "all"):
        rows, verdicts, per_corpus, met, partly = looping(args)
        result["looping"] = {"rows": rows, "per_corpus": per_corpus, "goal_met": met}
        common.write_results(
            args.out / "looping",
            name=f"{NAME}_looping",
            title="Looping on real text: one layer x T = 4 vs the same layer once vs 4 layers once",
            paper="ouro (Fig. 6, appendix B.2): a looped k x T model approaches the dense model of the same FLOPs",
            columns=["corpus", "model"] + [f"T={t}" for t in LOOPS],
            rows=rows,
            verdict=" ".join(verdicts)
            + ". Goal: >= 50% of the gap at T = 4 on both corpora and T = 8 no worse than T = 4.",
            reproduced=True if met else ("partly" if partly else False),
            command=f"python -m experiments.{NAME} --part looping --seeds {','.join(map(str, args.seeds))}",
            smoke=args.smoke,
            extra={"seeds": args.seeds, "loops": LOOPS, "per_corpus": per_corpus},
        )
    if args.part in ("directions", "all"):
        rows, out = directions(args)
        result["directions"] = out
        b, q = out["blind_spot"], out["q_exit"]
        s = {n: [r[7] - r[3] for r in v] for n, v in out["stars"].items()}
        verdict = (
            f"Blind spot: ||H_K||_2 of the RMSNorm readout is {min(b['norm_over_max_raw_penalty']):.1f}-"
            f"{max(b['norm_over_max_raw_penalty']):.1f}x the larger of raw / penalty (paper: orders of magnitude). "
            f"Q-exit: {q['below_static']} of {q['of']} operating points below {T_TRAIN} loops have a loss at or under "
            f"static exit's at the same average loops. STARS: T=8 - T=4 is "
            f"{common.mean_std(s['stars_on'])[0]:+.3f} with the regularizer, {common.mean_std(s['stars_off'])[0]:+.3f} "
            "without."
        )
        common.write_results(
            args.out / "directions",
            name=f"{NAME}_directions",
            title="The seed papers' directions on real text (tinyshakespeare, character level)",
            paper="readout blind spot Table 2; ouro §3.2 Q-exit; STARS §5 Fig. 5",
            columns=["direction", "variant", "measure", "held-out loss"],
            rows=rows,
            verdict=verdict,
            reproduced=None,
            command=f"python -m experiments.{NAME} --part directions --seeds {','.join(map(str, args.seeds))}",
            smoke=args.smoke,
            extra={"seeds": args.seeds, **out},
        )
    (args.out / "results.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    for part in ("looping", "directions"):
        if (args.out / part / "results.md").is_file():
            print((args.out / part / "results.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
