"""Loop efficiency: does looping cost exactly the FLOPs it adds?

Train step (forward + backward + AdamW) of a LoopLM with N layers x T loops and its per-loop objectives on
(Stage I over every loop + the scale penalty) against an unshared dense model of N*T layers with the same
width trained on a final-loop CE, same tokens. Each model's achieved FLOP/s = (model FLOPs per token, counting
loops and every decoded readout) x tokens / median step time; the ratio loop/dense is the figure of merit
(target >= 0.95). Both are measured in the same run, alternating, after warm-up.

    python benchmarks/loop_efficiency.py [--layers 2] [--loops 4] [--hidden 256] [--seq-len 256] [--out f.json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import emit, time_repeated  # noqa: E402
from titanloop.model import LoopLM, LoopLMConfig  # noqa: E402
from titanloop.objectives import per_loop_cross_entropy, scale_penalty, stage1_loss  # noqa: E402


def make_step(model: LoopLM, ids: torch.Tensor, per_loop: bool):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    inputs, targets = ids[:, :-1], ids[:, 1:]
    mask = torch.ones_like(targets, dtype=torch.bool)

    def step():
        out = model(inputs)
        if per_loop:
            ce = per_loop_cross_entropy(out.readouts, model.lm_head.weight, targets)
            loss, _ = stage1_loss(ce, out.gate_logits, mask, beta=0.05)
            loss = loss + scale_penalty(out.states, mask, 0.01)
        else:
            ce = per_loop_cross_entropy(out.readouts[-1:], model.lm_head.weight, targets)
            loss = ce.mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def run(layers=2, loops=4, hidden=256, heads=4, vocab=8192, seq_len=256, batch=4, warmup=2, repeats=5, seed=0):
    torch.manual_seed(seed)
    base = dict(vocab_size=vocab, hidden_size=hidden, n_heads=heads, ffn_hidden_size=int(hidden * 8 / 3) // 8 * 8,
                max_seq_len=seq_len, max_loops=max(16, loops))
    loop_cfg = LoopLMConfig(n_layers=layers, n_loops=loops, **base)
    dense_cfg = LoopLMConfig(n_layers=layers * loops, n_loops=1, **base)
    ids = torch.randint(0, vocab, (batch, seq_len + 1))
    tokens = batch * seq_len
    candidates = {
        "looplm": (make_step(LoopLM(loop_cfg), ids, True), loop_cfg.flops_per_token(seq_len, n_loops=loops)),
        "dense": (make_step(LoopLM(dense_cfg), ids, False), dense_cfg.flops_per_token(seq_len, n_loops=1)),
    }
    timings = time_repeated({k: v[0] for k, v in candidates.items()}, warmup=warmup, repeats=repeats)
    rows = []
    for name, (_, fpt) in candidates.items():
        t = timings[name]
        rows.append({"model": name, "flops_per_token": fpt, "median_s": t["median"], "min_s": t["min"],
                     "max_s": t["max"], "achieved_flops_per_s": fpt * tokens / t["median"]})
    ratio = rows[0]["achieved_flops_per_s"] / rows[1]["achieved_flops_per_s"]
    return {"benchmark": "loop_efficiency", "layers": layers, "loops": loops, "hidden": hidden, "vocab": vocab,
            "seq_len": seq_len, "batch": batch, "repeats": repeats, "rows": rows,
            "ratio_looplm_over_dense": ratio, "target": 0.95, "meets_target": ratio >= 0.95}


def print_table(res: dict) -> None:
    print(f"Loop efficiency: LoopLM {res['layers']} layers x {res['loops']} loops (Stage I + scale penalty on every "
          f"loop) vs dense {res['layers'] * res['loops']} layers, hidden {res['hidden']}, vocab {res['vocab']}, "
          f"{res['batch']}x{res['seq_len']} tokens")
    print(f"{'model':<8} {'GFLOP/tok':>10} {'median s':>9} {'spread s':>17} {'GFLOP/s':>9}")
    for r in res["rows"]:
        print(f"{r['model']:<8} {r['flops_per_token'] / 1e9:>10.3f} {r['median_s']:>9.3f} "
              f"{r['min_s']:>8.3f}-{r['max_s']:<8.3f} {r['achieved_flops_per_s'] / 1e9:>9.2f}")
    print(f"ratio looplm/dense achieved FLOP/s = {res['ratio_looplm_over_dense']:.3f} (target >= {res['target']})")


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
