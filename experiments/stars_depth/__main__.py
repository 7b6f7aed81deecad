"""STARS on real text with one shared map: does the Jacobian regularizer lower the recurrent map's spectral radius
and keep the held-out loss from rising past the trained depth?

Three arms of experiments/stars_depth/base.toml (one shared layer, no per-loop norm, inter-loop norm on, raw
readout, the embedding injected at every loop; tinyshakespeare, 2,000 steps):
  fixed      T = 4 at every step
  sampled    T ~ round(exp(N(ln 4, 0.3))) in [1, 8] per step
  jsrr       sampled T plus JSRR: (1 - 0.1) CE + 0.1 ||J v||^2, one power-iteration step (stars §5)
Each run scores the whole held-out split at T = 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64 at its last step, and the
spectral radius rho(J_Phi) of its recurrent map is estimated (20 power-iteration steps) at x_4 and x_16, the inputs
of loops 5 and 17, on the first held-out batches (titanloop.eval.diagnostics.spectral_radius).

Pass rule (written before any run): the direction holds if the jsrr arm's mean rho at x_16 and its mean
L(32) - L(4) are both lower than the sampled arm's by more than two seed standard deviations (the larger of the
two arms' standard deviations).

    python -m experiments.stars_depth --seeds 1,2,3 [--parallel 3] [--smoke]
"""

from __future__ import annotations

import sys
from pathlib import Path

from experiments import common

NAME = "stars_depth"
CONFIG = "experiments/stars_depth/base.toml"
CORPUS = "shakespeare_char"
LOOPS = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]
T_TRAIN = 4
RHO_AT = (4, 16)  # x_t: the input of loop t + 1
PAPER = (
    "stars §5 (JSRR lambda = 0.1, single-step power iteration, one shared recurrent map): the regularizer bounds "
    "the spectral radius of the map's Jacobian, so extra test-time loops do not drive the state away and "
    "quality holds far past the training depth."
)
ARMS = {
    "fixed": {"loop_sampler.kind": "fixed"},
    "sampled": {},
    "jsrr": {"objective.jsrr_weight": 0.1},
}
SMOKE = {  # a few steps, the first held-out batch only
    "training.steps": 6,
    "validation.freq": 6,
    "validation.steps": 1,
    "validation.batch_size": 16,
    "validation.loops": [1, 4, 8],
    "checkpoint.interval": 6,
}


def spectral_radii(run_dir: Path, batches: list[dict], rows: int) -> dict:
    """Mean rho(J_Phi) at x_t for t in RHO_AT over `batches` (`rows` rows each) of the run's last checkpoint."""
    from titanloop.eval.diagnostics import spectral_radius

    model = common.load(run_dir)
    got = {t: [] for t in RHO_AT}
    for b in batches:
        for r in spectral_radius(model, b, [t + 1 for t in RHO_AT], rows=rows, power_steps=20):
            got[r["loop"] - 1].append(r["rho_mean"])
    return {t: sum(v) / len(v) for t, v in got.items()}


def heldout_by_t(run_dir: Path, loops: list[int]) -> list[float]:
    last = [r for r in common.metrics(run_dir) if "val/loss/loop_1" in r][-1]
    return [last[f"val/loss/loop_{t}"] for t in loops]


def main(argv=None) -> int:
    args = common.parse_args(NAME, __doc__.split("\n\n")[0], argv)
    from data_pipelines.corpora import build
    from experiments.blind_spot_prenorm.__main__ import held_out_batches

    build(CORPUS)
    loops = SMOKE["validation.loops"] if args.smoke else LOOPS
    jobs = [
        (
            CONFIG,
            args.out / f"{arm}_s{seed}",
            {
                **over,
                "training.seed": seed,
                "data.seed": seed,
                "loop_sampler.seed": seed,
                **(SMOKE if args.smoke else {}),
            },
        )
        for arm, over in ARMS.items()
        for seed in args.seeds
    ]
    runs = iter(common.train_many(jobs, args.parallel, **common.run_options(args)))
    batches = held_out_batches(args.smoke)[: 1 if args.smoke else 4]
    rows_per_batch = 4 if args.smoke else 32
    far = loops[-1] if args.smoke else 32
    res, rows = {}, []
    for arm in ARMS:
        curves, rho, rise = [], {t: [] for t in RHO_AT}, []
        for seed in args.seeds:
            run = next(runs)
            curves.append(heldout_by_t(run, loops))
            for t, v in spectral_radii(run, batches, rows_per_batch).items():
                rho[t].append(v)
            rise.append(curves[-1][loops.index(far)] - curves[-1][loops.index(T_TRAIN)])
            print(
                f"[{NAME}] {arm} seed {seed}: held-out loss by T {dict(zip(loops, curves[-1]))}; rho at x_4, x_16 "
                f"{rho[4][-1]:.3f}, {rho[16][-1]:.3f}",
                flush=True,
            )
        res[arm] = {"heldout": curves, "rho": rho, "rise": rise}
        row = {"arm": arm}
        row.update({f"T={t}": common.mean_std([c[i] for c in curves]) for i, t in enumerate(loops)})
        row = {k: (f"{v[0]:.3f} ± {v[1]:.3f}" if isinstance(v, tuple) else v) for k, v in row.items()}
        row[f"L({far})-L(4)"] = "{:+.3f} ± {:.3f}".format(*common.mean_std(rise))
        for t in RHO_AT:
            row[f"rho(x_{t})"] = "{:.3f} ± {:.3f}".format(*common.mean_std(rho[t]))
        rows.append(row)

    def lower(key, t=None):
        a = res["jsrr"][key] if t is None else res["jsrr"][key][t]
        b = res["sampled"][key] if t is None else res["sampled"][key][t]
        (ma, sa), (mb, sb) = common.mean_std(a), common.mean_std(b)
        return mb - ma, 2 * max(sa, sb)

    (d_rho, need_rho), (d_rise, need_rise) = lower("rho", 16), lower("rise")
    reproduced = d_rho > need_rho and d_rise > need_rise
    verdict = (
        f"JSRR lowers rho at x_16 by {d_rho:+.3f} (two seed std: {need_rho:.3f}) and L({far}) - L(4) by "
        f"{d_rise:+.3f} (two seed std: {need_rise:.3f}) against sampled T alone. Pass rule: both lower by more than "
        "two seed standard deviations."
    )
    seeds = ",".join(map(str, args.seeds))
    common.write_results(
        args.out,
        name=NAME,
        title="STARS with one shared map on tinyshakespeare: spectral radius and loss to T = 64",
        paper=PAPER,
        columns=["arm", *[f"T={t}" for t in loops], f"L({far})-L(4)", *[f"rho(x_{t})" for t in RHO_AT]],
        rows=rows,
        verdict=verdict,
        reproduced=reproduced,
        smoke=args.smoke,
        command=f"python -m experiments.{NAME} --seeds {seeds}",
        extra={"seeds": args.seeds, "loops": loops, "per_arm": res},
    )
    common.plot(
        args.out / "loss_vs_loops.png",
        {
            arm: (loops, [common.mean_std([c[i] for c in r["heldout"]])[0] for i in range(len(loops))])
            for arm, r in res.items()
        },
        xlabel="loops T",
        ylabel="held-out loss (nats/char), mean over seeds",
        title="Held-out loss against depth",
        logx=True,
        vline=T_TRAIN,
    )
    print((args.out / "results.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
