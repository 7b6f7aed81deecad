"""Activation checkpointing for looped models: peak memory vs loop count T, with and without per-loop checkpointing.

Without checkpointing, activations grow linearly with T (every loop's layers are saved for backward). With
per-loop checkpointing (`model.loop_wrapper`, what `parallelism.activation_checkpoint = "loop"` sets) only each
loop's input is kept and the loop is recomputed in backward: memory grows by one hidden state per loop, at the
cost of one extra forward of the stack. Peak memory is tensor-storage bytes (benchmarks.common.PeakMemory);
the step-time cost is the median ratio of checkpointed to plain step time, measured alternately in one run.

    python benchmarks/activation_checkpointing.py [--loops 1 2 4 8] [--hidden 256] [--seq-len 256] [--out f.json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import MiB, emit, peak_memory, per_loop_checkpointing, time_repeated, training_step  # noqa: E402
from titanloop.model import LoopLM, LoopLMConfig  # noqa: E402


def run(loops=(1, 2, 4, 8), layers=2, hidden=256, vocab=8192, seq_len=256, batch=4, warmup=1, repeats=3):
    torch.manual_seed(0)
    cfg = LoopLMConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        n_heads=4,
        ffn_hidden_size=int(hidden * 8 / 3) // 8 * 8,
        n_layers=layers,
        n_loops=max(loops),
        max_loops=max(16, max(loops)),
        max_seq_len=seq_len,
    )
    plain, ckpt = LoopLM(cfg), LoopLM(cfg)
    ckpt.load_state_dict(plain.state_dict())
    ckpt.loop_wrapper = per_loop_checkpointing
    ids = torch.randint(0, vocab, (batch, seq_len + 1))
    rows = []
    for t in loops:
        steps = {"none": training_step(plain, ids, t), "loop": training_step(ckpt, ids, t)}
        mem = {k: peak_memory(fn, m).peak_bytes for (k, fn), m in zip(steps.items(), (plain, ckpt))}
        times = time_repeated(steps, warmup=warmup, repeats=repeats)
        rows.append(
            {
                "n_loops": t,
                "peak_mib_no_ac": mem["none"] / MiB,
                "peak_mib_loop_ac": mem["loop"] / MiB,
                "memory_ratio": mem["loop"] / mem["none"],
                "step_s_no_ac": times["none"]["median"],
                "step_s_loop_ac": times["loop"]["median"],
                "time_ratio": times["loop"]["median"] / times["none"]["median"],
            }
        )
    return {
        "benchmark": "activation_checkpointing",
        "layers": layers,
        "hidden": hidden,
        "vocab": vocab,
        "seq_len": seq_len,
        "batch": batch,
        "repeats": repeats,
        "rows": rows,
    }


def print_table(res: dict) -> None:
    print(
        f"Activation checkpointing per loop: {res['layers']} layers, hidden {res['hidden']}, vocab {res['vocab']}, "
        f"{res['batch']}x{res['seq_len']} tokens, Stage I objective"
    )
    print(
        f"{'T':>3} {'peak MiB':>9} {'peak MiB AC':>12} {'mem ratio':>10} {'step s':>8} {'step s AC':>10} "
        f"{'time ratio':>10}"
    )
    for r in res["rows"]:
        print(
            f"{r['n_loops']:>3} {r['peak_mib_no_ac']:>9.1f} {r['peak_mib_loop_ac']:>12.1f} "
            f"{r['memory_ratio']:>10.2f} "
            f"{r['step_s_no_ac']:>8.3f} {r['step_s_loop_ac']:>10.3f} {r['time_ratio']:>10.2f}"
        )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--loops", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    if any(t < 1 for t in a.loops):
        p.error(f"--loops {a.loops}: every loop count must be >= 1")
    res = run(tuple(a.loops), a.layers, a.hidden, a.vocab, a.seq_len, a.batch, repeats=a.repeats)
    emit(res, print_table, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
