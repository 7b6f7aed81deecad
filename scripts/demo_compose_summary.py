"""The demo's comparison (scripts/demo_compose.sh): read the held-out depth sweeps of the looped (T = 4) and baseline
(T = 1) runs of every seed, print the table, write the depth curve and runs/demo_compose/summary.json.

    python scripts/demo_compose_summary.py runs/demo_compose --seeds 0,1,2

Expects runs/demo_compose/eval/{looped,baseline}_s<seed>/report.json (`python -m titanloop.eval sweep`) and the training
logs runs/demo_compose/{looped,baseline}_s<seed>/metrics.jsonl. summary.json is {"metric": "accuracy", "seeds": [...],
"looped": {"T": 4, "heldout": [...]}, "baseline": {"T": 1, "heldout": [...]}} (one held-out exact-match accuracy per
seed, each model at its trained depth); depth_curve.json holds the whole sweep (accuracy and loss at every T, per
seed); loss_curves.json / loss_curves.png hold the per-loop training CE of every run against the step
({variant: {seed: {"step": [...], "ce": [[loop 1..T] per logged step]}}}), so a loop that stalls is visible.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from experiments.common import loss_curve  # noqa: E402  (the repository root, for `python scripts/...`)

VARIANTS = ("looped", "baseline")
# `scripts/demo_compose.sh --iso-flop`: a dense model with T x the layers run once (the looped one's FLOPs per token)
ISO_FLOP = "isoflop"


def mean_std(values: list[float]) -> tuple[float, float]:
    m = sum(values) / len(values)
    return m, (math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0)


def load_sweeps(root: Path, seeds: list[int], variants=VARIANTS) -> dict:
    """{variant: {"trained_T": int, "loops": [...], "accuracy": [[per seed] per T], "loss": [[...] per T]}}."""
    out = {}
    for variant in variants:
        reports = []
        for seed in seeds:
            path = root / "eval" / f"{variant}_s{seed}" / "report.json"
            if not path.is_file():
                sys.exit(f"error: {path} is missing: run scripts/demo_compose.sh (it trains and evaluates every seed)")
            reports.append(json.loads(path.read_text())["depth_sweep"])
        loops = reports[0]["loops"]
        out[variant] = {
            "trained_T": reports[0]["trained_loops"],
            "loops": loops,
            "accuracy": [[r["points"][i]["sequence_accuracy"] for r in reports] for i in range(len(loops))],
            "loss": [[r["points"][i]["loss"] for r in reports] for i in range(len(loops))],
        }
    return out


def load_curves(root: Path, seeds: list[int], variants=VARIANTS) -> dict:
    """{variant: {seed: {"step": [...], "ce": [[per loop] per logged step]}}} from each run's metrics.jsonl."""
    out = {}
    for variant in variants:
        out[variant] = {}
        for seed in seeds:
            path = root / f"{variant}_s{seed}" / "metrics.jsonl"
            if not path.is_file():
                sys.exit(f"error: {path} is missing: run scripts/demo_compose.sh (every training run logs there)")
            out[variant][str(seed)] = loss_curve(path.parent)
    return out


def plot_curves(path: Path, curves: dict, seeds: list[int]) -> None:
    """One panel per seed: the looped run's training CE per loop, and the baseline's (T = 1) dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(5, len(seeds))
    rows = math.ceil(len(seeds) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.8 * rows), squeeze=False, sharey=True)
    for ax, seed in zip(axes.flat, seeds):
        looped, base = curves["looped"][str(seed)], curves["baseline"][str(seed)]
        for t in range(len(looped["ce"][0]) if looped["ce"] else 0):
            ax.plot(looped["step"], [max(c[t], 1e-4) for c in looped["ce"]], label=f"looped, loop {t + 1}")
        ax.plot(base["step"], [max(c[-1], 1e-4) for c in base["ce"]], "k--", label="baseline (T=1)")
        ax.set(yscale="log", title=f"seed {seed}", xlabel="step")
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(seeds) :]:
        ax.axis("off")
    axes[0][0].set_ylabel("training CE of the answer")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot(path: Path, sweeps: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for variant, s in sweeps.items():
        label = f"{variant} (trained at T={s['trained_T']})"
        for ax, key in zip(axes, ("accuracy", "loss")):
            stats = [mean_std(v) for v in s[key]]
            ax.errorbar(
                s["loops"], [m for m, _ in stats], yerr=[e for _, e in stats], marker="o", capsize=3, label=label
            )
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
    p.add_argument("root", type=Path, help="the demo's run directory (runs/demo_compose)")
    p.add_argument("--seeds", required=True, help="comma-separated seeds, e.g. 0,1,2")
    p.add_argument(
        "--iso-flop",
        action="store_true",
        help="also report the iso-FLOP dense model (runs isoflop_s<seed>, from scripts/demo_compose.sh --iso-flop)",
    )
    args = p.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    variants = VARIANTS + ((ISO_FLOP,) if args.iso_flop else ())
    sweeps = load_sweeps(args.root, seeds, variants)
    at = {v: s["loops"].index(s["trained_T"]) for v, s in sweeps.items()}
    summary = {
        "metric": "accuracy",
        "seeds": seeds,
        "looped": {"T": sweeps["looped"]["trained_T"], "heldout": sweeps["looped"]["accuracy"][at["looped"]]},
        "baseline": {"T": sweeps["baseline"]["trained_T"], "heldout": sweeps["baseline"]["accuracy"][at["baseline"]]},
    }
    if args.iso_flop:
        summary[ISO_FLOP] = {"T": sweeps[ISO_FLOP]["trained_T"], "heldout": sweeps[ISO_FLOP]["accuracy"][at[ISO_FLOP]]}
    (args.root / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (args.root / "depth_curve.json").write_text(json.dumps(sweeps, indent=1) + "\n")
    plot(args.root / "depth_curve.png", sweeps)
    curves = load_curves(args.root, seeds, variants)
    (args.root / "loss_curves.json").write_text(json.dumps(curves) + "\n")
    plot_curves(args.root / "loss_curves.png", curves, seeds)

    print(f"\nHeld-out answer accuracy (mean ± std over seeds {seeds}; loss in brackets):")
    print(
        f"{'eval T':>6} | "
        + " | ".join(f"{v + ' (trained T=' + str(s['trained_T']) + ')':>34}" for v, s in sweeps.items())
    )
    for i, t in enumerate(sweeps["looped"]["loops"]):
        cells = []
        for s in sweeps.values():
            (am, asd), (lm, lsd) = mean_std(s["accuracy"][i]), mean_std(s["loss"][i])
            cells.append(f"{100 * am:6.1f}% ± {100 * asd:4.1f} [{lm:5.3f} ± {lsd:5.3f}]")
        print(f"{t:>6} | " + " | ".join(f"{c:>34}" for c in cells))
    lm, ls = mean_std(summary["looped"]["heldout"])
    bm, bs = mean_std(summary["baseline"]["heldout"])
    print(
        f"\nlooped T={summary['looped']['T']}: {100 * lm:.1f}% ± {100 * ls:.1f}   vs   same parameters at "
        f"T={summary['baseline']['T']}: {100 * bm:.1f}% ± {100 * bs:.1f}   ->   {100 * (lm - bm):+.1f} points"
    )
    if args.iso_flop:
        im, isd = mean_std(summary[ISO_FLOP]["heldout"])
        print(
            f"iso-FLOP dense model (T x the layers, run once): {100 * im:.1f}% ± {100 * isd:.1f}   ->   looped "
            f"{100 * (lm - im):+.1f} points"
        )
    iso_head = f" | {'iso-FLOP':>8}" if args.iso_flop else ""
    print(
        f"\n{'seed':>4} | {'looped':>7} | {'T=1':>7} | {'margin':>7}{iso_head} | "
        "final training CE per loop (looped; T=1)"
    )
    for i, (s, a, b) in enumerate(zip(seeds, summary["looped"]["heldout"], summary["baseline"]["heldout"])):
        ce_l, ce_b = curves["looped"][str(s)]["ce"], curves["baseline"][str(s)]["ce"]
        last = " ".join(f"{c:.3f}" for c in ce_l[-1]) if ce_l else "-"
        last_b = f"{ce_b[-1][-1]:.3f}" if ce_b else "-"
        iso = f" | {100 * summary[ISO_FLOP]['heldout'][i]:7.1f}%" if args.iso_flop else ""
        print(f"{s:>4} | {100 * a:6.1f}% | {100 * b:6.1f}% | {100 * (a - b):+7.1f}{iso} | {last}; {last_b}")
    margins = [a - b for a, b in zip(summary["looped"]["heldout"], summary["baseline"]["heldout"])]
    print(
        f"margin: mean {100 * mean_std(margins)[0]:+.1f} ± {100 * mean_std(margins)[1]:.1f} points, "
        f"smallest {100 * min(margins):+.1f} (seed {seeds[margins.index(min(margins))]})"
    )
    print(
        f"wrote {args.root / 'summary.json'}, {args.root / 'depth_curve.png'}, {args.root / 'depth_curve.json'}, "
        f"{args.root / 'loss_curves.png'}, {args.root / 'loss_curves.json'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
