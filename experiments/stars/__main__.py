"""STARS, Fig. 5: with JSRR + log-normal loop sampling the accuracy stays flat as the test-time loop count grows far
past the training depth; the plain looped model decays.

Two runs on multi-digit addition, both with 2 shared layers: "plain" trains at a fixed T = 4; "stars" samples T
per step from a log-normal (STARS §4.3.1) and adds the Jacobian spectral-radius regularizer
L = (1 − λ) CE + λ ‖J v‖² (λ = 0.1, stars §5). Both are scored on held-out sums at T = 1, 2, 4, 8, 16, 32.

    python -m experiments.stars [--seeds 0,1,2] [--smoke]
"""

from __future__ import annotations

import sys

from experiments import common

NAME = "stars"
CONFIG = "experiments/stars/base.toml"
LOOPS = [1, 2, 4, 8, 16, 32]
LEARNED = 0.90  # mean held-out exact match at T = 4 both variants need before the verdict counts
PAPER = (
    "Fig. 5 (4-digit addition, T_train = 4 median, log-normal μ = 2, σ = 0.7, range [1, 100], JSRR λ = 0.1): "
    "with STARS accuracy stays at 100% for every test-time loop count; without it (Fig. 3) accuracy "
    "collapses once the loop count exceeds the training range."
)
VARIANTS = {
    "plain": {},
    # median exp(1.4) ≈ 4 loops, like the plain run's T = 4 (the paper's μ = 2 has median 7.4; scaled down for CPU)
    "stars": {
        "loop_sampler.kind": "lognormal",
        "loop_sampler.mu": 1.4,
        "loop_sampler.sigma": 0.5,
        "loop_sampler.min_sampled": 1,
        "loop_sampler.max_sampled": 12,
        "objective.jsrr_weight": 0.1,
    },
}


def main(argv=None) -> int:
    args = common.parse_args(NAME, __doc__.split("\n\n")[0], argv)
    loops = [1, 4, 8] if args.smoke else LOOPS
    curves, rows = {}, []
    for name, overrides in VARIANTS.items():
        per_seed = []
        for seed in args.seeds:
            extra = {"training.seed": seed, "loop_sampler.seed": seed, **({"training.steps": 6} if args.smoke else {})}
            run = common.train(CONFIG, args.out / f"{name}_s{seed}", {**overrides, **extra}, **common.run_options(args))
            # 424 distinct held-out sums exist for this task
            points = common.heldout(run, loops=loops, n_examples=64 if args.smoke else 384)
            per_seed.append([p["sequence_accuracy"] for p in points])
            print(f"[{NAME}] {name} seed {seed}: accuracy by T {dict(zip(loops, per_seed[-1]))}", flush=True)
        means = [common.mean_std([s[i] for s in per_seed]) for i in range(len(loops))]
        curves[name] = [m for m, _ in means]
        row = {"variant": name}
        row.update({f"T={t}": f"{m:.3f} ± {s:.3f}" for t, (m, s) in zip(loops, means)})
        row["per_seed"] = per_seed
        rows.append(row)
    i4, last = loops.index(4), len(loops) - 1
    # Pass rule (written before the recorded 3-seed run; not to be moved after seeing results):
    #   judged only if both variants learned the task: mean held-out exact match >= 90% at T = 4 (the training T;
    #   STARS' median); otherwise "not judged" with the accuracies.
    #   yes:    on the mean, stars loses >= 5 points less than plain from T = 4 to T = 32, keeps >= 90% of its
    #           T = 4 accuracy at T = 32, and on every seed stars' drop is smaller than plain's.
    #   partly: stars loses >= 5 points less than plain on the mean, but one of the other two conditions fails.
    #   no:     otherwise.
    drop = {n: c[i4] - c[last] for n, c in curves.items()}
    seed_drops = {n: [s[i4] - s[last] for s in r["per_seed"]] for n, r in zip(curves, rows)}
    learned = all(c[i4] >= LEARNED for c in curves.values())
    less = drop["stars"] <= drop["plain"] - 0.05
    keeps = curves["stars"][last] >= 0.9 * curves["stars"][i4]
    every_seed = all(s < p for s, p in zip(seed_drops["stars"], seed_drops["plain"]))
    reproduced = None if not learned else (True if less and keeps and every_seed else "partly" if less else False)
    verdict = (
        ""
        if learned
        else f"Not judgeable: a variant did not learn the task (mean accuracy at T=4: plain {curves['plain'][i4]:.3f}, "
        f"stars {curves['stars'][i4]:.3f}; the rule asks >= {LEARNED:.2f}). "
    )
    verdict += (
        f"Mean accuracy drop from T=4 to T={loops[-1]}: plain {drop['plain']:+.3f}, stars {drop['stars']:+.3f}; "
        f"stars keeps {curves['stars'][last] / max(curves['stars'][i4], 1e-9):.0%} of its T=4 accuracy; "
        f"per seed (plain / stars): "
        + ", ".join(f"{p:+.3f} / {s:+.3f}" for p, s in zip(seed_drops["plain"], seed_drops["stars"]))
        + f". Pass rule: both variants >= {LEARNED:.0%} at T=4 (else not judged); yes = stars drops >= 5 points "
        "less than plain on the mean, keeps >= 90% of its T=4 accuracy at T=32 and drops less than plain on every "
        "seed; partly = only the first holds; no = not even that."
    )
    common.write_results(
        args.out,
        name=NAME,
        title="STARS (Fig. 5): accuracy vs test-time loops, plain vs JSRR + log-normal loop sampling",
        paper=PAPER,
        columns=["variant"] + [f"T={t}" for t in loops],
        rows=rows,
        verdict=verdict,
        reproduced=reproduced,
        smoke=args.smoke,
        command=f"python -m experiments.{NAME}",
        extra={"seeds": args.seeds, "loops": loops, "mean_accuracy": curves},
    )
    common.plot(
        args.out / "accuracy_vs_loops.png",
        {n: (loops, c) for n, c in curves.items()},
        xlabel="loops T",
        ylabel="held-out exact-match accuracy",
        title="Addition: accuracy vs test-time loops",
        logx=True,
        vline=4,
    )
    print((args.out / "results.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
