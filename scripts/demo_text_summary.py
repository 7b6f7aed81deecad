"""The real-text demo's comparison (scripts/demo.sh): held-out loss of the looped model, the same layer run once and
the dense model of the same FLOPs, at every evaluated loop count, from each run's last validation (the whole held-out
split, `validation.steps = 0`).

    python scripts/demo_text_summary.py runs/demo

Reads runs/demo/{looped,once,dense}/metrics.jsonl; prints the table (every T any model was scored at; '-' where a
model was not), how much of the gap between the one-layer model and the dense one looping closes at the trained T,
and, for every scored T past it (8, 16, 32, ...), how far the looped model's loss there is from its loss at the
trained T; writes runs/demo/summary.json ({"loops": [...], "trained_T": 4, "heldout": {model: [loss per T]},
"gap_closed": x, "loss_at_max_minus_trained": y, "past_trained": {"T": loss at T minus at the trained T}}).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

MODELS = {  # run dir name -> (column title, trained T is the looped model's)
    "looped": "looped: 1 layer x T",
    "once": "same layer, T = 1",
    "dense": "dense: T layers, T = 1",
}


def last_validation(run_dir: Path) -> dict:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        sys.exit(f"error: {path} is missing: run scripts/demo.sh (it trains every model there)")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if any(k.startswith("val/loss/loop_") for k in r)]
    if not rows:
        sys.exit(f"error: {path} has no validation: train with validation.enable = true")
    return rows[-1]


def summarize(root: Path, trained_t: int) -> dict:
    vals = {name: last_validation(root / name) for name in MODELS}
    loops = sorted({int(k.rsplit("_", 1)[1]) for v in vals.values() for k in v if k.startswith("val/loss/loop_")})
    heldout = {name: [v.get(f"val/loss/loop_{t}") for t in loops] for name, v in vals.items()}
    if trained_t not in loops or heldout["looped"][loops.index(trained_t)] is None:
        sys.exit(f"error: the looped model was not scored at its trained T = {trained_t}: pass --trained-loops")
    once, dense = heldout["once"][loops.index(1)], heldout["dense"][loops.index(1)]
    looped = heldout["looped"][loops.index(trained_t)]
    scored = [(t, v) for t, v in zip(loops, heldout["looped"]) if v is not None]
    return {
        "loops": loops,
        "trained_T": trained_t,
        "tokens": int(vals["looped"]["val/tokens"]),
        "heldout": heldout,
        "gap_closed": (once - looped) / (once - dense) if once != dense else None,
        "loss_at_max_minus_trained": scored[-1][1] - looped,
        "past_trained": {str(t): v - looped for t, v in scored if t > trained_t},
    }


def _direction(d: float) -> str:
    return "worse" if d >= 0.0005 else ("better" if d <= -0.0005 else "same")  # as printed, to 3 decimals


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/demo_text_summary.py", description=__doc__.split("\n\n")[0])
    p.add_argument("root", type=Path, help="the demo's run directory (runs/demo)")
    p.add_argument("--trained-loops", type=int, default=4, help="the looped model's trained T (default 4)")
    args = p.parse_args(argv)
    s = summarize(args.root, args.trained_loops)
    t = s["trained_T"]
    print(f"\nHeld-out loss (nats per character) on the whole validation split ({s['tokens']:,} characters) by loop T:")
    print("eval T | " + " | ".join(f"{title:>24}" for title in MODELS.values()))
    for i, loops in enumerate(s["loops"]):
        cells = []
        for name in MODELS:
            v = s["heldout"][name][i]
            mark = " *" if (name == "looped" and loops == t) or (name != "looped" and loops == 1) else "  "
            cells.append(f"{'-' if v is None else f'{v:.3f}':>22}{mark}")
        print(f"{loops:>6} | " + " | ".join(cells))
    print("(* each model at the depth it was trained at)")
    once, dense = s["heldout"]["once"][s["loops"].index(1)], s["heldout"]["dense"][s["loops"].index(1)]
    looped = s["heldout"]["looped"][s["loops"].index(t)]
    if s["gap_closed"] is not None:
        print(
            f"\nlooping the one layer {t} times: {once:.3f} -> {looped:.3f}, {100 * s['gap_closed']:.0f}% of the way "
            f"to the dense model of the same FLOPs ({dense:.3f}, {t}x the parameters)"
        )
    past = s["past_trained"]
    if past:
        print(
            f"past the trained depth (loss at T minus at T = {t}): "
            + ", ".join(f"T = {k}: {d:+.3f} ({_direction(d)})" for k, d in past.items())
        )
    (args.root / "summary.json").write_text(json.dumps(s, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
