"""Loop efficiency: does looping cost exactly the FLOPs it adds?

Train step (forward + backward + AdamW) of a LoopLM with N layers x T loops and its per-loop objectives on
(Stage I over every loop + the scale penalty) against an unshared dense model of N*T layers with the same
width trained on a final-loop CE, same tokens; both through the trainer's objective (`loop_objective`). Each
model's achieved FLOP/s = (model FLOPs per token, counting loops and every decoded readout) x tokens / median
step time; the ratio loop/dense is the figure of merit (target >= 0.95). The pair is measured for each
`objective.ce_backward` (fused: each readout's logits formed once; recompute: the backward recomputes them), all
four candidates in the same run, alternating, after warm-up.

    python benchmarks/loop_efficiency.py [--layers 2] [--loops 4] [--hidden 256] [--seq-len 256] [--out f.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import emit, time_repeated  # noqa: E402
from titanloop.model import LoopLM, LoopLMConfig  # noqa: E402
from titanloop.objectives import ObjectiveConfig, loop_objective  # noqa: E402

CE_BACKWARDS = ("fused", "recompute")


def make_step(model: LoopLM, ids: torch.Tensor, per_loop: bool, ce_backward: str):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    inputs, targets = ids[:, :-1], ids[:, 1:]
    cfg = (
        ObjectiveConfig(name="stage1", beta=0.05, scale_penalty=0.01, ce_backward=ce_backward)
        if per_loop
        else ObjectiveConfig(name="final_only", ce_backward=ce_backward)
    )

    def step():
        out = model(inputs)
        loss, _ = loop_objective(cfg, out.readouts, out.states, out.gate_logits, targets, model.lm_head.weight)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def run(layers=2, loops=4, hidden=256, heads=4, vocab=8192, seq_len=256, batch=4, warmup=2, repeats=5, seed=0):
    torch.manual_seed(seed)
    base = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        n_heads=heads,
        ffn_hidden_size=int(hidden * 8 / 3) // 8 * 8,
        max_seq_len=seq_len,
        max_loops=max(16, loops),
    )
    loop_cfg = LoopLMConfig(n_layers=layers, n_loops=loops, **base)
    dense_cfg = LoopLMConfig(n_layers=layers * loops, n_loops=1, **base)
    ids = torch.randint(0, vocab, (batch, seq_len + 1))
    tokens = batch * seq_len
    loop_model, dense_model = LoopLM(loop_cfg), LoopLM(dense_cfg)
    candidates = {}
    for ce_backward in CE_BACKWARDS:
        candidates[("looplm", ce_backward)] = (
            make_step(loop_model, ids, True, ce_backward),
            loop_cfg.flops_per_token(seq_len, n_loops=loops),
        )
        candidates[("dense", ce_backward)] = (
            make_step(dense_model, ids, False, ce_backward),
            dense_cfg.flops_per_token(seq_len, n_loops=1),
        )
    timings = time_repeated({k: v[0] for k, v in candidates.items()}, warmup=warmup, repeats=repeats)
    rows = []
    for (name, ce_backward), (_, fpt) in candidates.items():
        t = timings[(name, ce_backward)]
        rows.append(
            {
                "model": name,
                "ce_backward": ce_backward,
                "flops_per_token": fpt,
                "median_s": t["median"],
                "min_s": t["min"],
                "max_s": t["max"],
                "times_s": t["times"],
                "achieved_flops_per_s": fpt * tokens / t["median"],
            }
        )
    by = {(r["model"], r["ce_backward"]): r for r in rows}
    ratios, spread = {}, {}
    for ce_backward in CE_BACKWARDS:
        loop, dense = by[("looplm", ce_backward)], by[("dense", ce_backward)]
        ratios[ce_backward] = loop["achieved_flops_per_s"] / dense["achieved_flops_per_s"]
        # per round (the four candidates run back to back in each round): min/median/max of the round's ratio
        per_round = sorted(
            loop["flops_per_token"] * d / (dense["flops_per_token"] * lt)
            for lt, d in zip(loop["times_s"], dense["times_s"])
        )
        spread[ce_backward] = {"min": per_round[0], "median": statistics.median(per_round), "max": per_round[-1]}
    ratio = ratios["fused"]
    return {
        "benchmark": "loop_efficiency",
        "layers": layers,
        "loops": loops,
        "hidden": hidden,
        "vocab": vocab,
        "seq_len": seq_len,
        "batch": batch,
        "warmup": warmup,
        "repeats": repeats,
        "rows": rows,
        "ratio_looplm_over_dense": ratio,
        "ratio_by_ce_backward": ratios,
        "per_round_ratio": spread,
        "target": 0.95,
        "meets_target": ratio >= 0.95,
    }


def print_table(res: dict) -> None:
    print(
        f"Loop efficiency: LoopLM {res['layers']} layers x {res['loops']} loops (Stage I + scale penalty on every "
        f"loop) vs dense {res['layers'] * res['loops']} layers, hidden {res['hidden']}, vocab {res['vocab']}, "
        f"{res['batch']}x{res['seq_len']} tokens"
    )
    print(f"{'model':<8} {'ce_backward':<11} {'GFLOP/tok':>10} {'median s':>9} {'spread s':>17} {'GFLOP/s':>9}")
    for r in res["rows"]:
        print(
            f"{r['model']:<8} {r['ce_backward']:<11} {r['flops_per_token'] / 1e9:>10.3f} {r['median_s']:>9.3f} "
            f"{r['min_s']:>8.3f}-{r['max_s']:<8.3f} {r['achieved_flops_per_s'] / 1e9:>9.2f}"
        )
    for ce_backward, ratio in res["ratio_by_ce_backward"].items():
        s = res["per_round_ratio"][ce_backward]
        print(
            f"ratio looplm/dense achieved FLOP/s, ce_backward={ce_backward}: {ratio:.3f} (per round min/median/max "
            f"{s['min']:.3f}/{s['median']:.3f}/{s['max']:.3f})"
        )
    print(f"target >= {res['target']} (ce_backward=fused, the default): {'met' if res['meets_target'] else 'NOT met'}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--loops", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    res = run(a.layers, a.loops, a.hidden, 4, a.vocab, a.seq_len, a.batch, a.warmup, a.repeats)
    emit(res, print_table, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
