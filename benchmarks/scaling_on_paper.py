"""Scaling on paper: tokens/s/GPU and step time for Ouro-1.4B and 2.6B at T = 4 on 8xH100, from the FLOP model.

No GPU is measured here: every figure is an ESTIMATE = assumed MFU x H100 bf16 dense peak / FLOPs per token,
where FLOPs per token come from LoopLMConfig.flops_per_token (it counts every loop, the per-loop LM head and
attention). The published anchors for dense 1-3B models on H100 (llm-foundry, OLMo-core, Megatron) are about
40-42% MFU; the looped stack runs the same kernels, so the same MFU is the working assumption.

    python benchmarks/scaling_on_paper.py [--mfu 0.40] [--seq-len 4096] [--gpus 8] [--out scaling.json]

--out writes the result in the benchmarks/report.py schema (the rows under "result").
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import regen_command, write_report  # noqa: E402
from titanloop.model.config import preset  # noqa: E402

H100_BF16_PEAK = 989e12  # dense bf16 FLOP/s of an H100 SXM
ANCHORS = "published dense 1-3B on H100: ~40-42% MFU (llm-foundry, OLMo-core, Megatron)"


def estimate(name: str, n_loops: int, seq_len: int, mfu: float, gpus: int, batch_tokens: int) -> dict:
    cfg = preset(name)
    fpt = cfg.flops_per_token(seq_len, n_loops=n_loops)
    fpt_final_only = cfg.flops_per_token(seq_len, n_loops=n_loops, readouts=1)
    tok_s_gpu = mfu * H100_BF16_PEAK / fpt
    return {
        "model": name,
        "n_loops": n_loops,
        "seq_len": seq_len,
        "params": cfg.param_count(),
        "flops_per_token": fpt,
        "flops_per_token_final_readout_only": fpt_final_only,
        "assumed_mfu": mfu,
        "tokens_per_s_per_gpu_est": tok_s_gpu,
        "tokens_per_s_node_est": tok_s_gpu * gpus,
        "step_time_s_est": batch_tokens / (tok_s_gpu * gpus),
        "batch_tokens": batch_tokens,
        "gpus": gpus,
        "days_per_trillion_tokens_node_est": 1e12 / (tok_s_gpu * gpus) / 86400,
    }


def run(mfu: float = 0.40, seq_len: int = 4096, gpus: int = 8, batch_tokens: int = 4 * 2**20) -> list[dict]:
    rows = [estimate(n, 4, seq_len, mfu, gpus, batch_tokens) for n in ("ouro-1.4b", "ouro-2.6b")]
    rows.append(estimate("ouro-1.4b", 8, seq_len, mfu, gpus, batch_tokens))  # stage 1a depth
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"Scaling on paper (ESTIMATES from the FLOP model; {ANCHORS})")
    print(
        f"{'model':<10} {'T':>2} {'params':>8} {'GFLOP/tok':>10} {'MFU':>5} {'tok/s/GPU':>10} "
        f"{'tok/s/node':>11} {'step s':>7} {'days/1T tok':>11}"
    )
    for r in rows:
        print(
            f"{r['model']:<10} {r['n_loops']:>2} {r['params'] / 1e9:>7.2f}B {r['flops_per_token'] / 1e9:>10.1f} "
            f"{r['assumed_mfu']:>5.0%} {r['tokens_per_s_per_gpu_est']:>10.0f} {r['tokens_per_s_node_est']:>11.0f} "
            f"{r['step_time_s_est']:>7.1f} {r['days_per_trillion_tokens_node_est']:>11.1f}"
        )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mfu", type=float, default=0.40, help="assumed model FLOPs utilization (default 0.40)")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--batch-tokens", type=int, default=4 * 2**20, help="global tokens per step (stage 1: 4M)")
    p.add_argument("--out", type=Path, help="write the rows as JSON here")
    a = p.parse_args(argv)
    if not 0 < a.mfu <= 1:
        p.error(f"--mfu={a.mfu} must be in (0, 1]")
    rows = run(a.mfu, a.seq_len, a.gpus, a.batch_tokens)
    print_table(rows)
    if a.out:
        write_report(a.out, "scaling_on_paper", to_report(rows, regen_command("scaling_on_paper", argv)))
    return 0


NAMES = {"ouro-1.4b": "Ouro-1.4B", "ouro-2.6b": "Ouro-2.6B"}


def to_report(rows: list[dict], command: str) -> dict:
    r0 = rows[0]

    def label(r):
        name = NAMES.get(r["model"], r["model"])
        return name + (" (stage 1a)" if r["model"] == "ouro-1.4b" and r["n_loops"] == 8 else "")

    return {
        "title": "Scaling on paper (`benchmarks/scaling_on_paper.py`): ESTIMATES, not measurements",
        "order": 70,
        "command": command,
        "machine": "no measurement: FLOP model with an assumed MFU",
        "summary": [],
        "tables": [
            {
                "columns": [
                    "model",
                    "T",
                    "params",
                    "GFLOP/token",
                    "tokens/s/GPU",
                    f"tokens/s per {r0['gpus']}xH100 node",
                    "days per 1T tokens per node",
                ],
                "rows": [
                    [
                        label(r),
                        r["n_loops"],
                        f"{r['params'] / 1e9:.2f}B",
                        f"{r['flops_per_token'] / 1e9:.1f}",
                        f"{r['tokens_per_s_per_gpu_est']:,.0f}",
                        f"{r['tokens_per_s_node_est']:,.0f}",
                        f"{r['days_per_trillion_tokens_node_est']:.1f}",
                    ]
                    for r in rows
                ],
            }
        ],
        "notes": [
            f"Assumed {r0['assumed_mfu']:.0%} MFU on H100 ({H100_BF16_PEAK / 1e12:.0f} TFLOP/s bf16 dense); "
            f"{ANCHORS}. FLOPs per token count every loop, the per-loop LM head and causal attention; sequence "
            f"length {r0['seq_len']}, {r0['batch_tokens']:,} tokens per step."
        ],
        "result": {"benchmark": "scaling_on_paper", "rows": rows},
    }


if __name__ == "__main__":
    sys.exit(main())
