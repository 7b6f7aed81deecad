"""torch.compile (inductor) of the looped block on CPU: compile time, eager-vs-compiled step time, recompiles.

The trainer's compile path (`parallelism.compile = true`: titanloop.parallel.apply_compile, each decoder layer
compiled, per-loop activation checkpointing around it) on one process: a LoopLM of 2 shared layers trained with
the Stage I objective. Measured in one run: the first compiled step (Dynamo + inductor + gcc) against an eager
step, then eager and compiled steps alternated (median of `--repeats` each) at T = 4, then one compiled step
at each other loop count to count recompilations (titanloop.parallel.compiled_graphs).

    python benchmarks/compile_speed.py [--hidden 256] [--seq-len 256] [--batch 4] [--out f.json]

Writes benchmarks/results/compile_speed.json (BENCHMARKS.md is generated from it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.report import measured_commit  # noqa: E402

import torch  # noqa: E402

from benchmarks.common import (  # noqa: E402
    fmt_spread,
    machine,
    per_loop_checkpointing,
    regen_command,
    spread,
    time_repeated,
    training_step,
)
from titanloop.model import LoopLM, LoopLMConfig  # noqa: E402
from titanloop.parallel.compile import apply_compile, compiled_graphs  # noqa: E402


def run(hidden=256, layers=2, vocab=4096, seq_len=256, batch=4, n_loops=4, other_loops=(2, 8), repeats=5) -> dict:
    torch.manual_seed(0)
    cfg = LoopLMConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        n_heads=4,
        ffn_hidden_size=int(hidden * 8 / 3) // 8 * 8,
        n_layers=layers,
        n_loops=n_loops,
        max_loops=16,
        max_seq_len=seq_len,
    )
    eager, compiled = LoopLM(cfg), LoopLM(cfg)
    compiled.load_state_dict(eager.state_dict())
    for m in (eager, compiled):  # what parallelism.activation_checkpoint = "loop" sets
        m.loop_wrapper = per_loop_checkpointing
    apply_compile(compiled, backend="inductor")
    ids = torch.randint(0, vocab, (batch, seq_len + 1))
    steps = {"eager": training_step(eager, ids, n_loops), "compiled": training_step(compiled, ids, n_loops)}

    t0 = time.perf_counter()
    loss_eager = steps["eager"]()
    eager_first = time.perf_counter() - t0
    t0 = time.perf_counter()
    loss_compiled = steps["compiled"]()
    compiled_first = time.perf_counter() - t0
    graphs_after_first = compiled_graphs()
    times = time_repeated(steps, warmup=1, repeats=repeats)
    for t in other_loops:  # a different loop count: same per-layer graphs
        training_step(compiled, ids, t)()
    graphs_after_all = compiled_graphs()
    # per round (eager and compiled alternate): the ratio depends on machine load, so min / median / max
    ratio_spread = spread([c / e for c, e in zip(times["compiled"]["times"], times["eager"]["times"])])
    ratio = ratio_spread["median"]
    return {
        "hidden": hidden,
        "layers": layers,
        "vocab": vocab,
        "seq_len": seq_len,
        "batch": batch,
        "n_loops": n_loops,
        "other_loops": list(other_loops),
        "repeats": repeats,
        "first_step_s": {"eager": eager_first, "compiled": compiled_first},
        "compile_s": compiled_first - eager_first,
        "step_s": {k: v["median"] for k, v in times.items()},
        "step_time_ratio": ratio,  # median of the per-round ratios
        "step_time_ratio_spread": ratio_spread,
        "first_loss": {"eager": loss_eager, "compiled": loss_compiled},
        "graphs_after_first_step": graphs_after_first,
        "graphs_after_other_loop_counts": graphs_after_all,
    }


def to_report(res: dict, command: str) -> dict:
    shape = (
        f"{res['layers']} layers x hidden {res['hidden']}, vocab {res['vocab']}, {res['batch']} x "
        f"{res['seq_len']} tokens, T = {res['n_loops']}, per-loop AC, Stage I"
    )
    return {
        "title": "torch.compile of the looped block on CPU (inductor)",
        "order": 45,
        "command": command,
        "date": datetime.date.today().isoformat(),
        "commit": measured_commit("compile_speed"),
        "machine": machine() + " (inductor C++ backend, gcc); times are one process's",
        "summary": [
            {
                "row": f"compiled / eager step time, {shape}; median of {res['repeats']} rounds (min "
                f"{res['step_time_ratio_spread']['min']:.3f}, max {res['step_time_ratio_spread']['max']:.3f})",
                "measured": round(res["step_time_ratio"], 3),
                "target": None,
                "met": None,
            },
            {
                "row": "compile time of the first step (s, CPU; on GPU it differs)",
                "measured": round(res["compile_s"], 1),
                "target": None,
                "met": None,
            },
            {
                "row": f"graphs recompiled when T changes ({res['n_loops']} -> "
                f"{', '.join(map(str, res['other_loops']))})",
                "measured": res["graphs_after_other_loop_counts"] - res["graphs_after_first_step"],
                "target": "= 0",
                "met": res["graphs_after_other_loop_counts"] == res["graphs_after_first_step"],
            },
        ],
        "tables": [
            {
                "columns": ["", "eager", "compiled"],
                "rows": [
                    [
                        "first step (s)",
                        round(res["first_step_s"]["eager"], 2),
                        round(res["first_step_s"]["compiled"], 2),
                    ],
                    ["median step (s)", round(res["step_s"]["eager"], 4), round(res["step_s"]["compiled"], 4)],
                    ["compiled / eager per round: min / median / max", "", fmt_spread(res["step_time_ratio_spread"])],
                    ["first-step loss", round(res["first_loss"]["eager"], 6), round(res["first_loss"]["compiled"], 6)],
                ],
            }
        ],
        "notes": [
            "CPU only: inductor's CPU code is not the GPU fast path (Triton kernels, flash attention); the "
            "ratio shows the compiled path runs and what it costs here, not the H100 speed-up. The trainer "
            "test (tests/test_train_compile.py) checks the same path under FSDP2 on 2 ranks for loss parity "
            "and recompiles. The compile time is one first step (not repeated).",
        ],
        "result": res,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "compile_speed.json")
    a = p.parse_args(argv)
    for name in ("hidden", "layers", "vocab", "seq_len", "batch", "repeats"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(a, name)}: must be >= 1")
    res = run(a.hidden, a.layers, a.vocab, a.seq_len, a.batch, repeats=a.repeats)
    report = to_report(res, regen_command("compile_speed", argv))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=1) + "\n")
    for row in report["summary"]:
        print(f"{row['row']}: {row['measured']}")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
