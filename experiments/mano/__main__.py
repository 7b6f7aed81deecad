"""Mano, ouro appendix B.2 / Fig. 6 right: on modular-arithmetic trees, a looped model beats the iso-parameter
non-looped model and matches or beats the iso-FLOP deeper one.

Three models trained identically on Mano trees with 1..L operators (the task's size, L = 3 mod 3, lives in
base.toml), in ouro's notation layers ⊗ loops: 1 ⊗ 4 (looped), 1 ⊗ 1 (same parameters, one pass) and 4 ⊗ 1 (same
FLOPs, 4x the layers). Reported: held-out exact-match accuracy by the number of operators in the tree (with the
task option heldout_min_ops = k, sizes below k hold nothing out and are scored on trained trees; a small eval
split is scored whole).

    python -m experiments.mano [--seeds 0,1,2] [--parallel 2] [--smoke]
"""

from __future__ import annotations

import sys
import tomllib

from experiments import common

NAME = "mano"
CONFIG = "experiments/mano/base.toml"
with open(common.REPO / CONFIG, "rb") as _f:
    TASK_OPTIONS = tomllib.load(_f)["data"]["task_options"]  # the task's size has one home: base.toml
MAX_OPS = TASK_OPTIONS["max_ops"]
LEARNED = 0.90  # in-distribution accuracy (mean over 1..MAX_OPS operators) the best model needs before judging
PAPER = (
    "Fig. 6 right (L = 10, 16, 24; 12-layer budget): looped k ⊗ 12/k models beat the iso-parameter "
    "{2, 3, 6} ⊗ 1 models and are better than or comparable to the iso-FLOP 12 ⊗ 1 model."
)
MODELS = {  # name -> overrides of base.toml
    "1x4 looped": {},
    "1x1 iso-param": {"loop_sampler.n_loops": 1},
    "4x1 iso-FLOP": {"model.n_layers": 4, "loop_sampler.n_loops": 1},
}


def n_scored(n_ops: int) -> int:
    """How many distinct trees of n_ops operators the eval split holds (held out, or below heldout_min_ops the
    trained table); counted by enumeration where the space is small (mod 3: 27 and 486 trees), else 10**9."""
    from itertools import product

    from titanloop.data.synthetic_tasks import build_task

    task = build_task("mano", **{**TASK_OPTIONS, "eval_ops": n_ops})
    p = task.modulus
    if 3**n_ops * p ** (n_ops + 1) * 14 > 10**6:  # 14 >= tree shapes for n_ops <= 4
        return 10**9

    def trees(n):  # every prefix tree of n operators, as tokens
        if n == 0:
            yield from ([str(v)] for v in range(p))
            return
        for left in range(n):
            for op, lt, rt in product("+-*", list(trees(left)), list(trees(n - 1 - left))):
                yield [op, *lt, *rt]

    prompts = (task.encode(["<bos>", f"<len_{n_ops}>", *t, "<ans>"]) for t in trees(n_ops))
    if n_ops < TASK_OPTIONS.get("heldout_min_ops", 1):
        return sum(1 for _ in prompts)
    return sum(task.in_eval(q) for q in prompts)


def main(argv=None) -> int:
    args = common.parse_args(NAME, __doc__.split("\n\n")[0], argv)
    from titanloop.data.synthetic_tasks import build_task

    ops_list = sorted({1, MAX_OPS}) if args.smoke else list(range(1, MAX_OPS + 1))
    acc, seed_acc, rows = {}, {}, []
    models = list(MODELS)[:2] if args.smoke else list(MODELS)  # CI: fewer launches, same code paths
    # trees scored per size, the same for every model and seed (small spaces: all of them)
    counts = {n: min(32 if args.smoke else (64 if n == 1 else 256), n_scored(n)) for n in ops_list}
    smoke = {"training.steps": 6} if args.smoke else {}
    jobs = [
        (CONFIG, args.out / f"{name.split()[0]}_s{seed}", {**MODELS[name], "training.seed": seed, **smoke})
        for name in models
        for seed in args.seeds
    ]
    runs = iter(
        common.train_many(jobs, args.parallel, **common.run_options(args))
    )  # `--parallel 2`: two runs at a time
    for name in models:
        per_ops = {n: [] for n in ops_list}
        for _seed in args.seeds:
            run = next(runs)
            loops = common.run_config(run)["model"].get("n_loops", 4)
            for n in ops_list:
                data = {
                    "kind": "synthetic_task",
                    "task": "mano",
                    "split": "eval",
                    "task_options": {**TASK_OPTIONS, "eval_ops": n},
                }
                scored = common.heldout(
                    run, loops=[loops], data=data, n_examples=counts[n], batch_size=min(64, counts[n])
                )
                per_ops[n].append(scored[0]["sequence_accuracy"])
        row = {"model": name}
        for n in ops_list:
            m, s = common.mean_std(per_ops[n])
            row[f"ops={n}"] = f"{m:.3f} ± {s:.3f}"
            acc[(name, n)] = m
            seed_acc[(name, n)] = per_ops[n]
        row["in-distribution"] = f"{sum(acc[(name, n)] for n in ops_list) / len(ops_list):.3f}"
        row["per_seed"] = {n: per_ops[n] for n in ops_list}
        rows.append(row)
        print(f"[{NAME}] {row}", flush=True)
    # Pass rule (written before the recorded 3-seed run; not to be moved after seeing results):
    #   (the models went from 2 ⊗ 4 / 2 ⊗ 1 / 8 ⊗ 1 to 1 ⊗ 4 / 1 ⊗ 1 / 4 ⊗ 1 with the third tuning round, before the
    #   recorded run on seeds 0, 1, 2: the demo's size; every threshold below is unchanged)
    #   judged only if some model learned the task: in-distribution accuracy (held-out exact match at the model's
    #   training T, mean over 1..MAX_OPS operators, the training mix) >= 90% for the best of the three models
    #   (mean over seeds); otherwise "not judged" with the accuracies.
    #   yes:    at MAX_OPS operators, looped 1x4 >= iso-parameter 1x1 + 5 points and >= iso-FLOP 4x1 - 5 points
    #           (means), and looped > 1x1 on every seed.
    #   partly: looped >= 1x1 + 5 points on the mean, but one of the other two conditions fails.
    #   no:     otherwise.
    hardest = ops_list[-1]
    names = list(MODELS)
    looped, iso_p, iso_f = (acc.get((m, hardest), float("nan")) for m in names)
    lp, ip, fp = (m.split()[0] for m in names)  # "1x4", "1x1", "4x1": the models' names have one home, MODELS
    in_dist = {m: sum(acc[(m, n)] for n in ops_list) / len(ops_list) for m in models}
    modulus = build_task("mano", **TASK_OPTIONS).modulus
    chance = 1 / modulus
    learned = max(in_dist.values()) >= LEARNED
    beats_p = looped >= iso_p + 0.05
    near_f = looped >= iso_f - 0.05
    every_seed = all(a > b for a, b in zip(seed_acc[(names[0], hardest)], seed_acc[(names[1], hardest)]))
    reproduced = None if not learned else True if beats_p and near_f and every_seed else "partly" if beats_p else False
    verdict = (
        ""
        if learned
        else "Not judgeable: no model learned the task (in-distribution accuracy "
        + ", ".join(f"{m} {a:.3f}" for m, a in in_dist.items())
        + f"; chance {chance:.3f}; the rule asks >= {LEARNED:.2f}), so the comparison below is between models "
        "that did not learn it. "
    )
    verdict += (
        f"At {hardest} operators: looped {lp} {looped:.3f}, iso-parameter {ip} {iso_p:.3f}, iso-FLOP {fp} "
        f"{iso_f:.3f}. Pass rule: the best model >= {LEARNED:.0%} in distribution (else not judged); yes = looped "
        f"beats {ip} by >= 5 points, is within 5 points of {fp} or above, and beats {ip} on every seed; partly = only "
        "the first holds; no = not even that."
    )
    common.write_results(
        args.out,
        name=NAME,
        title="Mano (ouro B.2): looped vs iso-parameter vs iso-FLOP",
        paper=PAPER,
        columns=["model"] + [f"ops={n}" for n in ops_list] + ["in-distribution"],
        rows=rows,
        verdict=verdict,
        reproduced=reproduced if learned else None,
        smoke=args.smoke,
        command=f"python -m experiments.{NAME}",
        extra={
            "seeds": args.seeds,
            "task_options": TASK_OPTIONS,
            "in_distribution": in_dist,
            "mean_accuracy": {f"{m}/ops{n}": a for (m, n), a in acc.items()},
        },
    )
    common.plot(
        args.out / "accuracy_by_ops.png",
        {m: (ops_list, [acc[(m, n)] for n in ops_list]) for m in models},
        xlabel="operators in the tree",
        ylabel="held-out exact-match accuracy",
        title=f"Mano (mod {modulus})",
    )
    print((args.out / "results.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
