"""`python benchmarks/looped_vs_dense.py`: titanloop's looped model against torchtitan's own dense trainer at equal
FLOPs per token, on one GPU.

    python benchmarks/looped_vs_dense.py                             # 2 launches of each (about 5 minutes, H100)
    python benchmarks/looped_vs_dense.py --smoke --out /tmp/lvd.json  # the CPU at tiny sizes (numbers meaningless)

The looped model: 6 shared layers x T = 4 at the Ouro-1.4B width (hidden 2048, 16 heads, FFN 5632, vocab 49152),
`torchrun -m titanloop.train`. The dense one: torchtitan 0.3.0's `torchtitan.train.main` with its llama3 model of the
same width (benchmarks/torchtitan_dense.py, the harness), with as many layers as make its FLOPs per token closest to
the looped model's, both counted by LoopLMConfig.flops_per_token over the runs' documents (the trainer's count; 30
layers). Both: 2 x 4096 tokens per step, bf16 compute with fp32 master weights and reduction, compile, no activation
checkpointing, fused AdamW, the same synthetic documents. Each pair is launched --launches times (one launch of a
shape can run up to 20% slower than another); the summary judges the median of the pairs' ratios, target >= 1.0.
Where the torchtitan run fails, titanloop's own trainer at T = 1 with the dense layer count is the baseline.
"""

from __future__ import annotations

import datetime
import json
import os
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's titanloop and benchmarks, when run as a script

from benchmarks.torchtitan_dense import SPEC_ENV, DenseSpec  # noqa: E402
from titanloop.checks import runs  # noqa: E402
from titanloop.model.config import LoopLMConfig, attended_keys_per_token, preset  # noqa: E402
from titanloop.train.launch import torchrun  # noqa: E402
from titanloop.train.mfu import device_name, peak_flops  # noqa: E402

LOOPED_LAYERS, MICRO_BATCH, STEPS, WARMUP = 6, 2, 8, 3


def synthetic_doc_lengths(seq_len: int, vocab: int, rows: int = 32, seed: int = 0) -> list[int]:
    """Document lengths of the first `rows` rows of the synthetic_text stream the runs train on: the attention part
    of FLOPs per token depends on them."""
    import numpy as np

    from titanloop.data.synthetic_text import SyntheticTextSource

    source, lengths = SyntheticTextSource(seq_len, vocab, seed, motif_vocab=runs.MOTIF_VOCAB), []
    for k in range(rows):
        lengths += [int(n) for n in np.unique(source.row(k).doc_ids[:seq_len], return_counts=True)[1]]
    return lengths


def dense_layers_for(looped: LoopLMConfig, seq_len: int, n_loops: int, doc_lengths=None) -> int:
    """The layer count of a dense model of the looped model's width (T = 1, one readout) whose FLOPs per token are
    closest to the looped model's at T = n_loops."""
    target = looped.flops_per_token(seq_len, n_loops=n_loops, doc_lengths=doc_lengths)

    def dense(n: int) -> float:
        return looped.replace(n_layers=n, n_loops=1).flops_per_token(seq_len, n_loops=1, doc_lengths=doc_lengths)

    return min(range(1, 4 * looped.n_layers * n_loops + 1), key=lambda n: abs(dense(n) - target))


def dense_throughput(rows: list[dict], warmup: int) -> dict:
    """Medians over torchtitan's logged steps after `warmup` (the harness's JSONL of its MetricsProcessor)."""
    used = [r for r in rows if r["step"] > warmup and "throughput(tps)" in r]
    if not used:
        raise ValueError(f"no logged step after the warm-up ({warmup} steps) to measure ({len(rows)} rows logged)")
    peaks = [r["memory/max_active(GiB)"] for r in rows if r.get("memory/max_active(GiB)", 0) > 0]
    return {
        "tokens_per_s_gpu": statistics.median(r["throughput(tps)"] for r in used),
        "peak_gib": max(peaks) if peaks else None,
        "torchtitan_mfu": statistics.median(r.get("mfu(%)", 0) for r in used) / 100,  # its count: full-square attention
    }


def run_titanloop(a, work: Path, name: str, n_layers: int, n_loops: int) -> dict:
    run_dir, log = work / name, work / f"{name}.log"
    args = runs.train_args(
        run_dir, a.preset, {"n_layers": n_layers}, n_loops, a.seq_len, 1, "bf16", a.steps, MICRO_BATCH, "none"
    )
    args += ["--metrics.log_freq", "1", "--metrics.breakdown", "false", "--model.vocab_size", str(a.vocab)]
    args += ["--lr_scheduler.warmup_steps", "2", "--parallelism.compile", str(not a.smoke).lower()]
    code = runs.run(torchrun(1, "-m", "titanloop.train", "--config", str(runs.TRAIN_CONFIG), *args), log, None)
    if code != 0:
        return {"status": "failed", "reason": runs.failure(code, log)}
    return {"status": "ok", **runs.median_throughput(runs.metrics(run_dir), a.warmup)}


def run_torchtitan(a, work: Path, name: str, n_layers: int) -> dict:
    cfg = preset(a.preset, vocab_size=a.vocab)
    folder = work / name
    spec = DenseSpec(
        dump_folder=str(folder), metrics_jsonl=str(folder / "metrics.jsonl"), n_layers=n_layers, dim=cfg.hidden_size,
        n_heads=cfg.n_heads, ffn_hidden_size=cfg.ffn_hidden_size, vocab_size=cfg.vocab_size, rope_theta=cfg.rope_theta,
        seq_len=a.seq_len, local_batch_size=MICRO_BATCH, steps=a.steps, lr=1e-3, warmup_steps=2, compile=not a.smoke,
        attn_backend="sdpa" if a.smoke else "flex", motif_vocab=runs.MOTIF_VOCAB,
    )  # fmt: skip
    folder.mkdir(parents=True)
    env = {**runs.environment(), SPEC_ENV: spec.to_env()}
    log = work / f"{name}.log"
    code = runs.run(torchrun(1, str(ROOT / "benchmarks" / "torchtitan_dense.py")), log, None, env)
    if code != 0:
        return {"status": "failed", "reason": runs.failure(code, log)}
    try:
        return {"status": "ok", **dense_throughput(runs.metrics(folder), a.warmup)}
    except ValueError as e:
        return {"status": "failed", "reason": str(e)}


def parse_args(argv):
    p = runs.benchmark_parser("python benchmarks/looped_vs_dense.py", __doc__, "looped-vs-dense")
    p.add_argument("--launches", type=int, default=2, help="launches of each run (default 2)")
    p.add_argument("--steps", type=int, default=STEPS, help=f"steps per run (default {STEPS})")
    a = p.parse_args(argv)
    if a.launches < 1 or a.steps < 2:
        p.error(f"--launches {a.launches} --steps {a.steps}: expected at least 1 launch and 2 steps")
    a.warmup = min(WARMUP, a.steps - 1)
    a.preset, a.seq_len, a.vocab = ("debug-tiny", 64, 512) if a.smoke else ("ouro-1.4b", 4096, 49152)
    return a


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parse_args(argv)
    import torch

    if not a.smoke and not torch.cuda.is_available():
        print("looped_vs_dense: no CUDA device (torch.cuda.is_available() is False): run it on a GPU, or --smoke")
        return 1
    runs.exit_on_sigterm()
    looped_layers = 2 if a.smoke else LOOPED_LAYERS
    lengths = synthetic_doc_lengths(a.seq_len, a.vocab)
    looped = preset(a.preset, vocab_size=a.vocab, n_layers=looped_layers)
    layers = dense_layers_for(looped, a.seq_len, 4, lengths)
    flops = {
        "looped": looped.flops_per_token(a.seq_len, n_loops=4, doc_lengths=lengths),
        "dense": looped.replace(n_layers=layers).flops_per_token(a.seq_len, n_loops=1, doc_lengths=lengths),
    }
    peak = peak_flops(device_name("cuda")) if not a.smoke else None
    rows, ratios = [], []
    with tempfile.TemporaryDirectory(prefix="looped_vs_dense_") as tmp:
        for launch in range(1, a.launches + 1):
            lr = run_titanloop(a, Path(tmp), f"looped-{launch}", looped_layers, 4)
            dr = run_torchtitan(a, Path(tmp), f"torchtitan-{launch}", layers)
            pair = [(f"titanloop looped, {looped_layers} layers x T=4", "looped", lr)]
            pair.append((f"torchtitan dense llama3, {layers} layers", "dense", dr))
            if dr["status"] != "ok":  # the baseline falls back to titanloop's own dense model
                tl = run_titanloop(a, Path(tmp), f"titanloop-dense-{launch}", layers, 1)
                pair.append((f"titanloop dense, {layers} layers x T=1", "dense", tl))
            base = pair[-1][2]
            if lr["status"] == "ok" and base["status"] == "ok":
                ratios.append(lr["tokens_per_s_gpu"] / base["tokens_per_s_gpu"])
            rows += [[f"{label}, launch {launch}", kind, r] for label, kind, r in pair]
            print(f"launch {launch}: " + "; ".join(f"{label}: {r.get('tokens_per_s_gpu', r.get('reason'))}"
                                                for label, _, r in pair), flush=True)  # fmt: skip
    f = lambda x, spec: "" if x is None else format(x, spec)  # noqa: E731
    table = []
    for label, kind, r in rows:
        achieved = r.get("tokens_per_s_gpu", 0) * flops[kind]
        status = r["status"] + (f": {r['reason']}"[:160] if r.get("reason") else "")
        table.append([label, f(flops[kind] / 1e9, ".4g"), f(r.get("tokens_per_s_gpu"), ",.0f"),
                      f(achieved and achieved / 1e12, ".1f"), f(peak and achieved and 100 * achieved / peak, ".1f"),
                      f(r.get("peak_gib"), ".1f"), status])  # fmt: skip
    measured = round(statistics.median(ratios), 3) if ratios else "not measured (a run failed: see the table)"
    summary = {"row": f"looped / dense tokens/s ({looped_layers} layers x T=4 vs {layers} layers, equal FLOPs/token; "
               f"median of {len(ratios)} launch pairs: {', '.join(f'{x:.3f}' for x in ratios)})",
               "measured": measured, "target": ">= 1.0", "met": measured >= 1.0 if ratios else None}  # fmt: skip
    doc = {
        "title": "Looped vs dense at equal FLOPs per token", "torch": torch.__version__,
        "command": shlex.join(["python", "benchmarks/looped_vs_dense.py", *argv]), "commit": runs.git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "machine": (f"1 x {torch.cuda.get_device_name(0)}" if not a.smoke else "CPU (smoke run)")
        + f", torch {torch.__version__}",
        "summary": [summary],
        "tables": [{"title": f"Runs ({a.preset} width, {MICRO_BATCH} x {a.seq_len} tokens, no AC, bf16; MFU by the "
                    "trainer's count over the documents, attended keys per token "
                    f"{attended_keys_per_token(a.seq_len, lengths):.0f})",
                    "columns": ["run", "GFLOP/token", "tokens/s/GPU", "TFLOP/s", "MFU %", "peak GiB", "status"],
                    "rows": table}],
        "notes": ["Differences that remain between the two trainers: torchtitan's FlexAttention (document mask) "
                  "against torch's varlen flash kernel, a plain (not chunked) cross-entropy, no sandwich norms, no "
                  "per-loop readouts. torchtitan's own MFU counts full-square attention."],
        "result": {"flops_per_token": flops, "ratios": ratios, "runs": rows},
    }  # fmt: skip
    a.out = runs.out_path(a, doc["machine"])
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{summary['row']}: {measured}\nwrote {a.out}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
