"""DICE, Table 1: dense supervision of every iterate (one shared readout) extrapolates to longer inputs and more
iterations; endpoint-only supervision does not.

Two runs on running XOR (prefix sums mod 2) of 12-bit strings at T = 4: "endpoint" (CE of the last loop only) and
"dense" (DICE eq. 2: ℓ(z_K) + α Σ_k w_k ℓ(z_k), linear w_k ∝ k, α = 1). Both are scored on held-out strings of
12, 16 and 24 bits at T = 4, 8 and 16 (exact match of the whole running-XOR answer).

Note the format difference: DICE's Deep Thinking nets emit every output bit in parallel, whereas here the answer
is decoded left to right with teacher forcing, so each output bit depends on the previous output bit and the
next input bit only.

    python -m experiments.dice [--seeds 0,1,2] [--smoke]
"""

from __future__ import annotations

import sys

from experiments import common

NAME = "dice"
CONFIG = "experiments/dice/base.toml"
TRAIN_BITS = 12  # 4,096 strings, ~200 of them held out
PAPER = (
    "Table 1 (Deep Thinking nets on prefix sums, 40 test iterations): endpoint supervision 11.7% at 64 bits and "
    "0% at 128; DICE 100% at 64, 72 and 128 bits, 11.9% at 256: dense supervision extrapolates in length."
)
VARIANTS = {
    "endpoint": {"objective.name": "final_only"},
    "dense": {"objective.name": "dense", "objective.dense_schedule": "linear", "objective.dense_alpha": 1.0},
}


def main(argv=None) -> int:
    args = common.parse_args(NAME, __doc__.split("\n\n")[0], argv)
    bits = [12, 16] if args.smoke else [12, 16, 24]
    loops = [4, 8] if args.smoke else [4, 8, 16]
    acc, rows, tables = {}, [], {}
    for name, overrides in VARIANTS.items():
        table = tables[name] = {}  # (bits, T) -> per-seed accuracy
        for seed in args.seeds:
            extra = {"training.seed": seed, **({"training.steps": 6} if args.smoke else {})}
            run = common.train(CONFIG, args.out / f"{name}_s{seed}", {**overrides, **extra}, **common.run_options(args))
            for n in bits:
                data = {
                    "kind": "synthetic_task",
                    "task": "xor",
                    "split": "eval",
                    "task_options": {"n_bits": TRAIN_BITS, "eval_n_bits": n},
                }
                points = common.heldout(run, loops=loops, data=data, n_examples=64 if args.smoke else 128)
                for p in points:
                    table.setdefault((n, p["loops"]), []).append(p["sequence_accuracy"])
        for n in bits:
            row = {"variant": name, "test_bits": n}
            row["per_seed"] = {f"T={t}": table[(n, t)] for t in loops}
            for t in loops:
                m, s = common.mean_std(table[(n, t)])
                row[f"T={t}"] = f"{m:.3f} ± {s:.3f}"
                acc[(name, n, t)] = m
            rows.append(row)
            print(f"[{NAME}] {row}", flush=True)
    # Pass rule (the yes clause is the one recorded on seed 0; the per-seed and partly clauses were written for the
    # 3-seed run, before it ran, after seeing seed 0's result):
    #   yes:    at the longest test length and the most loops, dense is ahead of endpoint by >= 10 points on the
    #           mean and ahead on every seed (the paper's headline: length extrapolation).
    #   partly: not that, but dense is ahead by >= 10 points at the training length at the most loops (dense
    #           supervision keeps working past the training depth, without length extrapolation).
    #   no:     otherwise.
    longest, deepest = bits[-1], loops[-1]
    gap = acc[("dense", longest, deepest)] - acc[("endpoint", longest, deepest)]
    seed_gaps = [d - e for d, e in zip(tables["dense"][(longest, deepest)], tables["endpoint"][(longest, deepest)])]
    in_len = acc[("dense", TRAIN_BITS, deepest)] - acc[("endpoint", TRAIN_BITS, deepest)]
    yes = gap >= 0.1 and all(g > 0 for g in seed_gaps)
    reproduced = True if yes else "partly" if in_len >= 0.1 else False
    verdict = (
        f"At {longest} bits (trained on {TRAIN_BITS}) and T={deepest}: dense "
        f"{acc[('dense', longest, deepest)]:.3f} vs endpoint {acc[('endpoint', longest, deepest)]:.3f} "
        f"({gap:+.3f}; per seed " + ", ".join(f"{g:+.3f}" for g in seed_gaps) + f"); at {TRAIN_BITS} bits and "
        f"T={deepest}: {in_len:+.3f}. Pass rule: yes = dense ahead by >= 10 points at {longest} bits, T={deepest}, "
        f"on the mean and ahead on every seed; partly = not that, but ahead by >= 10 points at {TRAIN_BITS} bits, "
        f"T={deepest}; no = neither."
    )
    common.write_results(
        args.out,
        name=NAME,
        title="DICE (Table 1): dense vs endpoint supervision, length extrapolation",
        paper=PAPER,
        columns=["variant", "test_bits"] + [f"T={t}" for t in loops],
        rows=rows,
        verdict=verdict,
        reproduced=reproduced,
        smoke=args.smoke,
        command=f"python -m experiments.{NAME}",
        extra={
            "seeds": args.seeds,
            "train_bits": TRAIN_BITS,
            "mean_accuracy": {f"{v}/{n}bits/T{t}": a for (v, n, t), a in acc.items()},
        },
    )
    common.plot(
        args.out / "accuracy_vs_bits.png",
        {f"{v} T={deepest}": (bits, [acc[(v, n, deepest)] for n in bits]) for v in VARIANTS},
        xlabel="test bits",
        ylabel="held-out exact-match accuracy",
        title=f"Running XOR, trained on {TRAIN_BITS} bits",
        vline=TRAIN_BITS,
    )
    print((args.out / "results.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
