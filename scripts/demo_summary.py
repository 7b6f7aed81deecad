"""The demo's comparison (scripts/demo.sh): read the held-out depth sweeps of the looped (T = 4) and baseline
(T = 1) runs of every seed, print the table, write the depth curve and runs/demo/summary.json.

    python scripts/demo_summary.py runs/demo --seeds 0,1,2

Expects runs/demo/eval/{looped,baseline}_s<seed>/report.json (`python -m titanloop.eval sweep`). summary.json is
{"metric": "accuracy", "seeds": [...], "looped": {"T": 4, "heldout": [...]}, "baseline": {"T": 1, "heldout":
[...]}} (one held-out exact-match accuracy per seed, each model at its trained depth); depth_curve.json holds the
whole sweep (accuracy and loss at every T, per seed).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

VARIANTS = ("looped", "baseline")


def mean_std(values: list[float]) -> tuple[float, float]:
    m = sum(values) / len(values)
    return m, (math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0)


def load_sweeps(root: Path, seeds: list[int]) -> dict:
    """{variant: {"trained_T": int, "loops": [...], "accuracy": [[per seed] per T], "loss": [[...] per T]}}."""
    out = {}
    for variant in VARIANTS:
        reports = []
        for seed in seeds:
            path = root / "eval" / f"{variant}_s{seed}" / "report.json"
            if not path.is_file():
                sys.exit(f"error: {path} is missing: run scripts/demo.sh (it trains and evaluates every seed)")
            reports.append(json.loads(path.read_text())["depth_sweep"])
        loops = reports[0]["loops"]
        out[variant] = {"trained_T": reports[0]["trained_loops"], "loops": loops,
                        "accuracy": [[r["points"][i]["sequence_accuracy"] for r in reports] for i in range(len(loops))],
                        "loss": [[r["points"][i]["loss"] for r in reports] for i in range(len(loops))]}
    return out


def plot(path: Path, sweeps: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for variant, s in sweeps.items():
        label = f"{variant} (trained at T={s['trained_T']})"
        for ax, key in zip(axes, ("accuracy", "loss")):
            stats = [mean_std(v) for v in s[key]]
            ax.errorbar(s["loops"], [m for m, _ in stats], yerr=[e for _, e in stats], marker="o", capsize=3,
                        label=label)
    axes[0].set(xlabel="loops T at evaluation", ylabel="held-out answer accuracy", title="accuracy (mean ± std)")
    axes[1].set(xlabel="loops T at evaluation", ylabel="held-out answer loss", title="loss (mean ± std)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("root", type=Path, help="the demo's run directory (runs/demo)")
    p.add_argument("--seeds", required=True, help="comma-separated seeds, e.g. 0,1,2")
    args = p.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    sweeps = load_sweeps(args.root, seeds)
    at = {v: s["loops"].index(s["trained_T"]) for v, s in sweeps.items()}
    summary = {"metric": "accuracy", "seeds": seeds,
               "looped": {"T": sweeps["looped"]["trained_T"], "heldout": sweeps["looped"]["accuracy"][at["looped"]]},
               "baseline": {"T": sweeps["baseline"]["trained_T"],
                            "heldout": sweeps["baseline"]["accuracy"][at["baseline"]]}}
    (args.root / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (args.root / "depth_curve.json").write_text(json.dumps(sweeps, indent=1) + "\n")
    plot(args.root / "depth_curve.png", sweeps)

    print(f"\nHeld-out answer accuracy (mean ± std over seeds {seeds}; loss in brackets):")
    print(f"{'eval T':>6} | " + " | ".join(f"{v + ' (trained T=' + str(s['trained_T']) + ')':>34}"
                                           for v, s in sweeps.items()))
    for i, t in enumerate(sweeps["looped"]["loops"]):
        cells = []
        for s in sweeps.values():
            (am, asd), (lm, lsd) = mean_std(s["accuracy"][i]), mean_std(s["loss"][i])
            cells.append(f"{100 * am:6.1f}% ± {100 * asd:4.1f} [{lm:5.3f} ± {lsd:5.3f}]")
        print(f"{t:>6} | " + " | ".join(f"{c:>34}" for c in cells))
    lm, ls = mean_std(summary["looped"]["heldout"])
    bm, bs = mean_std(summary["baseline"]["heldout"])
    print(f"\nlooped T={summary['looped']['T']}: {100 * lm:.1f}% ± {100 * ls:.1f}   vs   same parameters at "
          f"T={summary['baseline']['T']}: {100 * bm:.1f}% ± {100 * bs:.1f}   ->   {100 * (lm - bm):+.1f} points")
    print("per seed:", ", ".join(f"seed {s}: {100 * a:.1f}% vs {100 * b:.1f}%" for s, a, b in
                                 zip(seeds, summary["looped"]["heldout"], summary["baseline"]["heldout"])))
    print(f"wrote {args.root / 'summary.json'}, {args.root / 'depth_curve.png'}, {args.root / 'depth_curve.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
