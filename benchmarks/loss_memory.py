"""Loss memory: does the per-loop objective cost memory beyond a final-loop-only loss?

One training step (forward + backward) of the same LoopLM at T loops with a large vocabulary, four ways:

    final_only        CE of the last loop only, chunked LM head (titanloop.objectives.linear_cross_entropy)
    final_only_dense  CE of the last loop only, full [tokens, V] logits (the usual F.cross_entropy)
    per_loop          Stage I over every loop (ouro eq. 4) with the chunked per-loop CE, logits recomputed in
                      backward (objective.ce_backward = "recompute")
    per_loop_naive    Stage I over every loop with full logits materialized for every loop
    final_only_fused  CE of the last loop only, fused readout (objective.ce_backward = "fused", the default)
    per_loop_fused    Stage I over every loop, fused readout: each loop's logits formed once, the LM-head
                      gradient formed in the forward  <- titanloop's default path

Peak memory is the peak of live tensor storages (benchmarks.common.PeakMemory: parameters, gradients,
activations, temporaries) during the step: a tensor count that does not depend on machine load. Target:
per_loop / final_only <= 1.15 (the issue's note). With --repeats, step times (load-dependent) are also measured,
variants alternating per round; step-time ratios are min / median / max of the per-round ratios.

--ac: activation checkpointing, peak memory vs loop count T with and without per-loop checkpointing (a record of its
own, <date>-<machine>-activation-checkpointing.json). Without checkpointing, activations grow linearly with T (every
loop's layers are saved for backward). With per-loop checkpointing (`model.loop_wrapper`, what
`parallelism.activation_checkpoint = "loop"` sets) only each loop's input is kept and the loop is recomputed in
backward: memory grows by one hidden state per loop, at the cost of one extra forward of the stack. Peak memory is
tensor-storage bytes (benchmarks.common.PeakMemory); the step-time cost is the ratio of checkpointed to plain step
time in each round (the two alternate), reported as min / median / max over the rounds (it depends on machine load;
memory does not).

    python benchmarks/loss_memory.py [--vocab 32768] [--hidden 256] [--layers 2] [--loops 4] [--batch 2]
                                     [--seq-len 256] [--chunk-size 4096] [--repeats 5] [--out f.json]
    python benchmarks/loss_memory.py --ac [--loops 1 2 4 8] [--hidden 256] [--seq-len 256] [--out f.json]

Each writes a new dated record, benchmarks/results/<date>-<machine>-<what>.json (or --out), the script's raw
figures under "result".
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (  # noqa: E402
    MiB,
    PeakMemory,
    fmt_spread,
    machine,
    peak_memory,
    per_loop_checkpointing,
    regen_command,
    spread,
    time_repeated,
    training_step,
    write_report,
)
from titanloop.model import LoopLM, LoopLMConfig  # noqa: E402
from titanloop.objectives import (
    dense_cross_entropy,
    final_loop_loss,
    fused_per_loop_cross_entropy,  # noqa: E402
    linear_cross_entropy,
    per_loop_cross_entropy,
    stage1_loss,
)
from titanloop.objectives.losses import stage1_linear_terms, token_weights  # noqa: E402

VARIANTS = ("final_only", "final_only_dense", "per_loop", "per_loop_naive", "final_only_fused", "per_loop_fused")
TARGET = 1.15


def loss_fn(variant: str, model: LoopLM, inputs, targets, mask, n_loops: int, chunk_size: int, beta: float):
    """The scalar training loss of one variant (forward included)."""
    out = model(inputs, n_loops=n_loops)
    head = model.lm_head.weight
    if variant == "final_only":
        return final_loop_loss(linear_cross_entropy(out.readouts[-1], head, targets, chunk_size), mask)
    if variant == "final_only_dense":
        return final_loop_loss(dense_cross_entropy(out.readouts[-1], head, targets), mask)
    if variant == "final_only_fused":
        return fused_per_loop_cross_entropy(out.readouts[-1:], head, targets, token_weights(mask)[None], chunk_size)[0]
    if variant == "per_loop_fused":
        w, reg = stage1_linear_terms(out.gate_logits, mask, beta)
        return fused_per_loop_cross_entropy(out.readouts, head, targets, w, chunk_size)[0] + reg
    if variant == "per_loop":
        ce = per_loop_cross_entropy(out.readouts, head, targets, chunk_size)
    else:
        ce = torch.stack([dense_cross_entropy(r, head, targets) for r in out.readouts])
    return stage1_loss(ce, out.gate_logits, mask, beta)[0]


def run(
    vocab=32768,
    hidden=256,
    heads=4,
    layers=2,
    loops=4,
    batch=2,
    seq_len=256,
    chunk_size=4096,
    beta=0.1,
    repeats=0,
    seed=0,
) -> dict:
    torch.manual_seed(seed)
    cfg = LoopLMConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        n_heads=heads,
        ffn_hidden_size=int(hidden * 8 / 3) // 8 * 8,
        n_layers=layers,
        n_loops=loops,
        max_seq_len=seq_len,
    )
    model = LoopLM(cfg)
    ids = torch.randint(0, vocab, (batch, seq_len + 1))
    inputs, targets = ids[:, :-1], ids[:, 1:]
    mask = torch.ones_like(targets, dtype=torch.bool)

    def step(variant):
        def fn():
            model.zero_grad(set_to_none=True)
            loss_fn(variant, model, inputs, targets, mask, loops, chunk_size, beta).backward()

        return fn

    rows, losses = [], {}
    for variant in VARIANTS:
        model.zero_grad(set_to_none=True)
        print(f"  measuring {variant} ...", file=sys.stderr, flush=True)
        with PeakMemory(model) as mem:
            loss = loss_fn(variant, model, inputs, targets, mask, loops, chunk_size, beta)
            loss.backward()
        losses[variant] = loss.item()
        kinds = mem.peak_by_kind
        rows.append(
            {
                "variant": variant,
                "peak_bytes": mem.peak_bytes,
                "peak_step_bytes": mem.peak_bytes - kinds.get("Parameter", 0),
                "peak_by_kind": kinds,
                "loss": loss.item(),
            }
        )
    if repeats:
        timings = time_repeated({v: step(v) for v in VARIANTS}, warmup=1, repeats=repeats)
        for row in rows:
            t = timings[row["variant"]]
            row.update(step_s_median=t["median"], step_s_min=t["min"], step_s_max=t["max"])

    by = {r["variant"]: r for r in rows}

    def ratio(a, b, key="peak_bytes"):
        return by[a][key] / by[b][key]

    ratios = {
        "per_loop/final_only": ratio("per_loop", "final_only"),
        "per_loop/final_only_dense": ratio("per_loop", "final_only_dense"),
        "per_loop_naive/final_only": ratio("per_loop_naive", "final_only"),
        "per_loop_naive/per_loop": ratio("per_loop_naive", "per_loop"),
        "step_only per_loop/final_only": ratio("per_loop", "final_only", "peak_step_bytes"),
        "per_loop_fused/final_only_fused": ratio("per_loop_fused", "final_only_fused"),
        "per_loop_fused/per_loop": ratio("per_loop_fused", "per_loop"),
        "final_only_fused/final_only": ratio("final_only_fused", "final_only"),
    }
    step_ratio_per_round = {}
    if repeats:
        ratios["step time per_loop_fused/per_loop"] = ratio("per_loop_fused", "per_loop", "step_s_median")
        ratios["step time final_only_fused/final_only"] = ratio("final_only_fused", "final_only", "step_s_median")
        for a, b in (("per_loop_fused", "per_loop"), ("final_only_fused", "final_only")):
            per_round = [x / y for x, y in zip(timings[a]["times"], timings[b]["times"])]
            step_ratio_per_round[f"{a}/{b}"] = spread(per_round)

    def matches_naive(variant):  # the Stage I variants compute the same loss; a mismatch means a bug is measured
        return abs(losses[variant] - losses["per_loop_naive"]) < 1e-4 * abs(losses["per_loop_naive"]) + 1e-5

    return {
        "benchmark": "loss_memory",
        "torch": torch.__version__,
        "device": "cpu",
        "config": {
            "vocab": vocab,
            "hidden": hidden,
            "heads": heads,
            "layers": layers,
            "loops": loops,
            "batch": batch,
            "seq_len": seq_len,
            "tokens": batch * seq_len,
            "chunk_size": chunk_size,
            "beta": beta,
            "params": model.num_params(),
        },
        "rows": rows,
        "ratios": ratios,
        "step_ratio_per_round": step_ratio_per_round,  # min / median / max over rounds (with repeats)
        "repeats": repeats,
        "target": TARGET,
        "meets_target": ratios["per_loop/final_only"] <= TARGET,
        "fused_meets_target": ratios["per_loop_fused/final_only_fused"] <= TARGET,
        "per_loop_matches_naive": matches_naive("per_loop"),
        "per_loop_fused_matches_naive": matches_naive("per_loop_fused"),
    }


def print_table(res: dict) -> None:
    c = res["config"]
    print(
        f"Loss memory, one fwd+bwd step: LoopLM {c['layers']} layers x T={c['loops']}, hidden {c['hidden']}, "
        f"vocab {c['vocab']}, {c['batch']}x{c['seq_len']} tokens, CE chunk {c['chunk_size']} tokens, "
        f"{c['params'] / 1e6:.1f}M params"
    )
    timed = "step_s_median" in res["rows"][0]
    print(f"{'variant':<18} {'peak MiB':>9} {'w/o params':>11}" + (f" {'step s':>8}" if timed else ""))
    for r in res["rows"]:
        line = f"{r['variant']:<18} {r['peak_bytes'] / MiB:>9.1f} {r['peak_step_bytes'] / MiB:>11.1f}"
        print(line + (f" {r['step_s_median']:>8.3f}" if timed else ""))
    for name, value in res["ratios"].items():
        print(f"  {name:<32} {value:6.3f}x")
    verdict = "meets" if res["meets_target"] else "MISSES"
    print(
        f"per_loop/final_only = {res['ratios']['per_loop/final_only']:.3f}x: {verdict} the target "
        f"<= {res['target']}x;"
        f" Stage I chunked == naive: {res['per_loop_matches_naive']}"
    )
    verdict = "meets" if res["fused_meets_target"] else "MISSES"
    print(
        f"fused: per_loop_fused/final_only_fused = {res['ratios']['per_loop_fused/final_only_fused']:.3f}x: "
        f"{verdict} the target <= {res['target']}x; Stage I fused == naive: {res['per_loop_fused_matches_naive']}"
    )


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--ac" in argv:
        return main_ac([x for x in argv if x != "--ac"])
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--vocab", type=int, default=32768, help="vocabulary size (the issue asks for >= 32K)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--loops", type=int, default=4, help="T")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--chunk-size", type=int, default=4096, help="tokens per chunk of the chunked CE")
    p.add_argument("--repeats", type=int, default=0, help="also time each step this many times (0 = memory only)")
    p.add_argument(
        "--out",
        type=Path,
        help="write the record here (default: a new dated record in benchmarks/results/)",
    )
    a = p.parse_args(argv)
    for name in ("vocab", "hidden", "heads", "layers", "loops", "batch", "seq_len", "chunk_size"):
        if getattr(a, name) < 1:
            raise SystemExit(f"error: --{name.replace('_', '-')}={getattr(a, name)} is invalid: expected >= 1")
    if a.hidden % a.heads:
        raise SystemExit(f"error: --heads={a.heads} is invalid: expected a divisor of --hidden={a.hidden}")
    res = run(a.vocab, a.hidden, a.heads, a.layers, a.loops, a.batch, a.seq_len, a.chunk_size, repeats=a.repeats)
    print_table(res)
    write_report(a.out, "loss_memory", to_report(res, regen_command("loss_memory", argv)))
    return 0


LABELS = {
    "final_only": "final-loop-only CE, chunked (logits recomputed in backward)",
    "final_only_dense": "final-loop-only CE, full logits",
    "per_loop": "Stage I over all {T} loops, chunked, logits recomputed in backward (ce_backward = recompute)",
    "per_loop_naive": "Stage I over all {T} loops, naive (full logits per loop)",
    "final_only_fused": "final-loop-only CE, fused readout",
    "per_loop_fused": "Stage I over all {T} loops, fused readout (ce_backward = fused, the default)",
}


def to_report(res: dict, command: str) -> dict:
    c, r = res["config"], res["ratios"]
    t, n = c["loops"], res["repeats"]
    summary = [
        {
            "row": f"per-loop objective memory: Stage I at T={t} / final-loop-only CE, vocab {c['vocab']:,}, fused "
            "readout (the default)",
            "measured": round(r["per_loop_fused/final_only_fused"], 3),
            "target": f"<= {TARGET}",
            "met": round(r["per_loop_fused/final_only_fused"], 3) <= TARGET,
        },
        {
            "row": "same, logits recomputed in backward (ce_backward = recompute)",
            "measured": round(r["per_loop/final_only"], 3),
            "target": f"<= {TARGET}",
            "met": round(r["per_loop/final_only"], 3) <= TARGET,
        },
        {
            "row": "same, naive per-loop (full logits per loop) / final-loop-only",
            "measured": round(r["per_loop_naive/final_only"], 3),
            "target": None,
            "met": None,
        },
        {
            "row": f"Stage I at T={t}, peak memory fused / recompute",
            "measured": round(r["per_loop_fused/per_loop"], 3),
            "target": None,
            "met": None,
        },
    ]
    timed = bool(res["step_ratio_per_round"])
    columns = ["variant", "peak MiB", "without params"]
    title = (
        f"Peak tensor memory of one forward+backward step (PyTorch MemTracker on CPU). LoopLM {c['layers']} layers, "
        f"T={t}, hidden {c['hidden']}, vocab {c['vocab']:,}, {c['batch']} x {c['seq_len']} tokens, CE chunk "
        f"{c['chunk_size']} tokens, {c['params'] / 1e6:.1f}M params"
    )
    notes = [
        "Every Stage I variant equals the naive one in value (chunked: "
        f"{res['per_loop_matches_naive']}, fused: {res['per_loop_fused_matches_naive']}).",
        "The fused readout's forward accumulates the LM head's gradient in place into one fp32 [V, H] buffer, "
        "while the recompute path's backward holds a recomputed [chunk, V] buffer, an fp32 [V, H] accumulator and "
        "a [V, H] matmul result at once. The fused path keeps the head's gradient (weight dtype) from forward to "
        "backward instead; with fp32 weights that buffer is the accumulator itself. Peak memory is a tensor count "
        "and does not depend on machine load.",
    ]
    if timed:
        s_loop = res["step_ratio_per_round"]["per_loop_fused/per_loop"]
        s_final = res["step_ratio_per_round"]["final_only_fused/final_only"]
        summary.append(
            {
                "row": f"Stage I at T={t}, step time fused / recompute, median of {n} rounds (min {s_loop['min']:.3f}, "
                f"max {s_loop['max']:.3f})",
                "measured": round(s_loop["median"], 3),
                "target": None,
                "met": None,
            }
        )
        columns += ["median step s", "spread s"]
        title += f"; step time: {n} timed rounds after 1 warm-up, variants alternating"
        notes.append(
            "Step time fused / recompute, per round (min / median / max): Stage I "
            f"{fmt_spread(s_loop)}, final-loop-only {fmt_spread(s_final)}."
        )
    rows = []
    for row in res["rows"]:
        cells = [
            LABELS[row["variant"]].format(T=t),
            f"{row['peak_bytes'] / MiB:.1f}",
            f"{row['peak_step_bytes'] / MiB:.1f}",
        ]
        if timed:
            cells += [f"{row['step_s_median']:.2f}", f"{row['step_s_min']:.2f}–{row['step_s_max']:.2f}"]
        rows.append(cells)
    return {
        "title": "Per-loop objective memory (`benchmarks/loss_memory.py`)",
        "command": command,
        "machine": machine(),
        "summary": summary,
        "tables": [{"title": title + ":", "columns": columns, "rows": rows}],
        "notes": notes,
        "result": res,
    }


def run_ac(loops=(1, 2, 4, 8), layers=2, hidden=256, vocab=8192, seq_len=256, batch=4, warmup=1, repeats=3):
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
                "time_ratio_per_round": spread([a / b for a, b in zip(times["loop"]["times"], times["none"]["times"])]),
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


def print_ac_table(res: dict) -> None:
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


def main_ac(argv) -> int:
    p = argparse.ArgumentParser(
        prog="python benchmarks/loss_memory.py --ac", description="per-loop activation checkpointing"
    )
    p.add_argument("--loops", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--out",
        type=Path,
        help="write the record here (default: a new dated record in benchmarks/results/)",
    )
    a = p.parse_args(argv)
    if any(t < 1 for t in a.loops):
        p.error(f"--loops {a.loops}: every loop count must be >= 1")
    res = run_ac(tuple(a.loops), a.layers, a.hidden, a.vocab, a.seq_len, a.batch, repeats=a.repeats)
    print_ac_table(res)
    write_report(a.out, "activation_checkpointing", ac_to_report(res, regen_command("loss_memory", ["--ac", *argv])))
    return 0


def ac_to_report(res: dict, command: str) -> dict:
    rows = res["rows"]
    ts = "/".join(str(r["n_loops"]) for r in rows)
    first, last = rows[0], rows[-1]
    dt = last["n_loops"] - first["n_loops"]
    notes = []
    if dt:
        grow = (last["peak_mib_no_ac"] - first["peak_mib_no_ac"]) / dt
        grow_ac = (last["peak_mib_loop_ac"] - first["peak_mib_loop_ac"]) / dt
        notes.append(
            f"Without checkpointing, memory grows by about {grow:.0f} MiB per loop; with it, by about {grow_ac:.0f} "
            "MiB per loop (one saved loop input)."
        )
    lo = min(r["time_ratio_per_round"]["median"] for r in rows)
    hi = max(r["time_ratio_per_round"]["median"] for r in rows)
    notes.append(
        "The expected cost is one extra forward of the stack per step (about 1.33x on a matmul-bound GPU); this "
        f"machine measured a median step-time ratio of {lo:.2f}-{hi:.2f}x over the loop counts. Step times depend "
        "on machine load; peak memory (a tensor count) does not."
    )
    return {
        "title": "Activation checkpointing per loop (`benchmarks/loss_memory.py --ac`)",
        "command": command,
        "machine": machine(),
        "summary": [
            {
                "row": f"activation checkpointing per loop: peak memory at T = {ts.replace('/', ' / ')}",
                "measured": " / ".join(f"{r['memory_ratio']:.2f}" for r in rows) + " of no-AC",
                "target": None,
                "met": None,
            },
            {
                "row": f"activation checkpointing: step time (median of {res['repeats']} rounds)",
                "measured": " / ".join(f"{r['time_ratio_per_round']['median']:.2f}" for r in rows) + " of no-AC",
                "target": None,
                "met": None,
            },
        ],
        "tables": [
            {
                "title": f"{res['layers']} layers, hidden {res['hidden']}, vocab {res['vocab']}, {res['batch']} x "
                f"{res['seq_len']} tokens, Stage I objective; step times are medians of {res['repeats']} "
                "alternated rounds, the time ratio min / median / max of the per-round ratios:",
                "columns": [
                    "T",
                    "peak MiB",
                    "peak MiB, per-loop AC",
                    "memory ratio",
                    "step s",
                    "step s, AC",
                    "time ratio (min / median / max)",
                ],
                "rows": [
                    [
                        r["n_loops"],
                        f"{r['peak_mib_no_ac']:.1f}",
                        f"{r['peak_mib_loop_ac']:.1f}",
                        f"{r['memory_ratio']:.2f}",
                        f"{r['step_s_no_ac']:.3f}",
                        f"{r['step_s_loop_ac']:.3f}",
                        fmt_spread(r["time_ratio_per_round"], ".2f"),
                    ]
                    for r in rows
                ],
            }
        ],
        "notes": notes,
        "result": res,
    }


if __name__ == "__main__":
    sys.exit(main())
