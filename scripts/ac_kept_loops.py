"""`python scripts/ac_kept_loops.py --config C --world-size N [overrides]`: how many loops per-loop activation
checkpointing can keep (`parallelism.ac_kept_loops`) on the GPUs a run is meant for, from the dry run's memory plan.

Per-loop AC (`parallelism.activation_checkpoint = "loop"`) recomputes every loop's forward in backward; keeping the
first k loops unrecomputed saves k loops of that recompute and holds k more loops' activations
(titanloop/parallel/activation_checkpoint.py). This runs the dry run's memory plan (`python -m titanloop.train
--dry-run --world-size N --memory-plan`: the config at its real world size on a fake process group, rank 0) for
k in 0..T, T the largest loop count the config's loop sampler draws (k = T keeps every loop: no recompute, the
memory of `activation_checkpoint = "none"`), and reports the largest k whose plan fits `--gpu-mem-gb` with the
plan's reserve. The plan grows with k, so a bisection over 0..T plans ceil(log2(T + 2)) of them (about 2 minutes
each for the 1.4B at world size 128 on 2 CPU cores); each plan is printed as it finishes.

Whatever AC the config sets, the plans are of per-loop AC with k kept loops. `--margin 0.1` also keeps 10% of the
planned peak free, for a setting whose plan has not been checked against a GPU's measured peak (the stage configs'
AC was chosen so). Exit 0 with the setting to use; 2 with one line when not even k = 0 fits or an argument is
invalid.

    python scripts/ac_kept_loops.py --config train_configs/stage1a.toml --world-size 128
    python scripts/ac_kept_loops.py --config train_configs/ouro_1p4b.toml --world-size 1 --training.micro_batch_size 1
    python scripts/ac_kept_loops.py --config C --world-size 8 --gpu-mem-gb 141 --json plans.json   # an H200
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from titanloop.config_errors import ConfigError, cli_errors, require  # noqa: E402
from titanloop.parallel.activation_checkpoint import describe as describe_ac  # noqa: E402
from titanloop.train.config import load_config  # noqa: E402
from titanloop.train.dry_run import dry_run  # noqa: E402
from titanloop.train.memory_plan import GB  # noqa: E402


def kept_overrides(k: int, n_loops: int) -> list[str]:
    """The overrides that keep the first k of n_loops loops (k = n_loops: no activation checkpointing at all)."""
    mode = "none" if k >= n_loops else "loop"
    return ["--parallelism.activation_checkpoint", mode, "--parallelism.ac_kept_loops", str(0 if k >= n_loops else k)]


def largest_fitting(n_loops: int, fits) -> tuple[int | None, dict[int, bool]]:
    """The largest k in 0..n_loops with fits(k) true, by bisection (fits is monotone: true up to some k, then
    false); None when fits(0) is false. Returns it and every k that was tried."""
    tried: dict[int, bool] = {}
    lo, hi = -1, n_loops + 1  # fits(lo) is true (or lo = -1), fits(hi) is false (or hi = n_loops + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        tried[mid] = fits(mid)
        lo, hi = (mid, hi) if tried[mid] else (lo, mid)
    return (lo if lo >= 0 else None), tried


def parse_args(argv):
    ap = argparse.ArgumentParser(
        prog="python scripts/ac_kept_loops.py",
        description=__doc__.split("\n\n")[0],
        epilog="Any other --section.key value is a config override, as for python -m titanloop.train. Each k is one "
        "dry-run memory plan (about 2 minutes for the 1.4B at world size 128 on 2 CPU cores), ceil(log2(T + 2)) "
        "of them by bisection, printed as they finish.",
    )
    ap.add_argument("--config", required=True, help="the training config (e.g. train_configs/stage1a.toml)")
    ap.add_argument("--world-size", type=int, required=True, help="the run's GPUs (nodes x GPUs per node)")
    ap.add_argument("--gpu-mem-gb", type=float, default=80.0, help="memory per GPU in GB (default 80: H100)")
    ap.add_argument("--reserve-gb", type=float, default=4.0, help="GB per GPU kept free (default 4, the plan's)")
    ap.add_argument(
        "--margin",
        type=float,
        default=0.0,
        help="also keep this fraction of the planned peak free (e.g. 0.1 for a plan not yet checked on the GPU "
        "at this setting; default 0: the plan's own rule)",
    )
    ap.add_argument(
        "--selective",
        action="store_true",
        help="also plan selective AC (matmul and attention outputs saved, the rest recomputed; one more plan) when "
        "not every loop fits: it holds part of every loop and recomputes no matmul",
    )
    ap.add_argument("--json", default=None, help="also write every plan made (k, peak GB, fits) to this file")
    return ap.parse_known_args(argv)


@cli_errors
def main(argv=None) -> int:
    a, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    require(a.world_size >= 1, "--world-size", a.world_size, "an integer >= 1 (nodes x GPUs per node)")
    require(0 <= a.margin < 1, "--margin", a.margin, "a fraction in [0, 1), e.g. 0.1")
    cfg = load_config(a.config, overrides, world_size=a.world_size)
    n_loops = cfg.loop_sampler.bounds()[1]
    now = describe_ac(cfg.parallelism.activation_checkpoint, cfg.parallelism.ac_kept_loops)
    print(
        f"{a.config} at world size {a.world_size} (now: AC {now}), up to T = {n_loops} loops; planning per-loop AC "
        f"with k kept loops, k in 0..{n_loops}, for {a.gpu_mem_gb:.0f} GB per GPU",
        flush=True,
    )
    plans: dict[int, dict] = {}

    def plan_of(extra: list[str], what: str):
        start = time.perf_counter()
        plan = dry_run(
            load_config(a.config, [*overrides, *extra], world_size=a.world_size),
            a.world_size,
            memory_plan=True,
            gpu_mem_gb=a.gpu_mem_gb,
        ).memory_plan
        plan = dataclasses.replace(plan, reserve_gb=a.reserve_gb + a.margin * plan.peak / GB)
        print(f"  {what}: {plan.verdict} ({time.perf_counter() - start:.0f} s)", flush=True)
        return {"peak_bytes": plan.peak, "peak_gb": round(plan.peak / GB, 2), "fits": plan.fits}

    def fits(k: int) -> bool:
        what = "every loop kept (no AC)" if k >= n_loops else f"k = {k}"
        plans[k] = {"kept_loops": k, **plan_of(kept_overrides(k, n_loops), what)}
        return plans[k]["fits"]

    best, _ = largest_fitting(n_loops, fits)
    selective = None
    if a.selective and (best is None or best < n_loops):
        selective = plan_of(["--parallelism.activation_checkpoint", "selective", "--parallelism.ac_kept_loops", "0"],
                            "selective AC")  # fmt: skip
    if a.json:
        Path(a.json).write_text(
            json.dumps(
                {
                    "config": a.config,
                    "world_size": a.world_size,
                    "gpu_mem_gb": a.gpu_mem_gb,
                    "reserve_gb": a.reserve_gb,
                    "margin": a.margin,
                    "n_loops": n_loops,
                    "largest": best,
                    "plans": [plans[k] for k in sorted(plans)],
                    "selective": selective,
                },
                indent=1,
            )
            + "\n"
        )
    if selective is not None:
        use = "; it recomputes no matmul: --parallelism.activation_checkpoint selective" if selective["fits"] else ""
        print(f"selective AC {'fits' if selective['fits'] else 'does not fit'} ({selective['peak_gb']:.1f} GB{use})")
    if best is None and not (selective and selective["fits"]):
        raise ConfigError(
            f"not even per-loop AC with no kept loops fits {a.gpu_mem_gb:.0f} GB per GPU at world size "
            f"{a.world_size}: fewer sequences per micro-batch (training.micro_batch_size) or more GPUs"
        )
    if best is None:
        return 0
    if best >= n_loops:
        print(f"every loop fits ({plans[best]['peak_gb']:.1f} GB): set --parallelism.activation_checkpoint none")
    else:
        print(
            f"largest that fits: --parallelism.ac_kept_loops {best} ({plans[best]['peak_gb']:.1f} GB planned; "
            f"backward recomputes {n_loops - best} of {n_loops} loops)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
