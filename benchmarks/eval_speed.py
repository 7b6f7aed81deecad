"""`python benchmarks/eval_speed.py`: evaluation and generation speed of the Ouro-1.4B shape on one GPU.

    python benchmarks/eval_speed.py                            # about 2 minutes on an H100
    python benchmarks/eval_speed.py --smoke --out /tmp/e.json  # the CPU at tiny sizes (numbers meaningless)

Two rows, on a randomly initialized ouro-1.4b (speed does not depend on the weights) in bf16 on the GPU:
  sweep      titanloop.eval.evaluate's depth sweep T = 1..8 plus the exit frontier (trained T = 4) over >= --tokens
             random tokens (default 1,048,576) in batches of 8 x 2048: seconds, tokens/s, token-loops/s of the
             device pass, peak GPU memory
  generate   greedy generation with the full KV cache at T = 4, a 128-token prompt and 64 new tokens, batch 1 and
             16: tokens/s overall and of decoding alone (the one-token run's prefill subtracted)
"""

from __future__ import annotations

import datetime
import json
import math
import shlex
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's titanloop, when run as a script

from titanloop.checks.runs import benchmark_parser, git_commit, out_path  # noqa: E402
from titanloop.eval import EvalConfig, evaluate  # noqa: E402
from titanloop.eval.generate import GenerationConfig, generate  # noqa: E402
from titanloop.model import LoopLM, preset  # noqa: E402

SIZES = {  # rows x seq of the sweep, prompt and new tokens of generation
    "full": {"model": {}, "rows": 8, "seq": 2048, "tokens": 1 << 20, "prompt": 128, "new": 64},
    "smoke": {"model": {"vocab_size": 4096, "hidden_size": 256, "n_heads": 4, "ffn_hidden_size": 1024,
                        "n_layers": 2}, "rows": 2, "seq": 64, "tokens": 512, "prompt": 16, "new": 8},
}  # fmt: skip


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def sweep(model: LoopLM, size: dict, device: torch.device) -> dict:
    rows, seq = size["rows"], size["seq"]
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(math.ceil(size["tokens"] / (rows * seq))):
        ids = torch.randint(0, model.cfg.vocab_size, (rows, seq + 1), generator=g)
        batches.append({"input_ids": ids[:, :-1], "labels": ids[:, 1:]})
    loops, marks = list(range(1, 9)), []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    _sync(device)
    t0 = time.perf_counter()
    report = evaluate(model, batches, EvalConfig(loops=loops, batch_size=rows, diagnostics=False),
                      progress=lambda m: marks.append(time.perf_counter()))  # fmt: skip
    seconds, device_s = time.perf_counter() - t0, marks[-1] - t0  # the last batch's statistics are on the host
    tokens = report["data"]["scored_tokens"]
    return {
        "tokens": tokens,
        "loops": loops,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "token_loops_per_s": tokens * len(loops) / device_s,
        "frontier_seconds": seconds - device_s,
        "peak_gpu_gb": torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None,
    }


@torch.no_grad()
def generation(model: LoopLM, size: dict, device: torch.device) -> list[dict]:
    out = []
    g = torch.Generator().manual_seed(2)
    for batch in (1, 16):
        prompt = torch.randint(0, model.cfg.vocab_size, (batch, size["prompt"]), generator=g).to(device)
        generate(model, prompt, GenerationConfig(max_new_tokens=2))  # warm-up

        def timed(n: int, prompt=prompt) -> float:
            _sync(device)
            t0 = time.perf_counter()
            generate(model, prompt, GenerationConfig(max_new_tokens=n))
            _sync(device)
            return time.perf_counter() - t0

        total, prefill = timed(size["new"]), timed(1)
        decode = max(total - prefill, 1e-9)
        out.append({"batch": batch, "seconds": total, "prefill_seconds": prefill,
                    "tokens_per_s": batch * size["new"] / total,
                    "decode_tokens_per_s": batch * (size["new"] - 1) / decode})  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = benchmark_parser("python benchmarks/eval_speed.py", __doc__, "eval-speed")
    p.add_argument("--tokens", type=int, default=None, help="tokens of the sweep (default 1048576; --smoke 512)")
    a = p.parse_args(argv)
    if a.tokens is not None and a.tokens < 1:
        p.error(f"--tokens {a.tokens}: expected an integer >= 1")
    if not a.smoke and not torch.cuda.is_available():
        print("eval_speed: no CUDA device (torch.cuda.is_available() is False): run it on a GPU, or --smoke")
        return 1
    size = {**SIZES["smoke" if a.smoke else "full"]}
    size["tokens"] = a.tokens or size["tokens"]
    device = torch.device("cpu" if a.smoke else "cuda")
    torch.manual_seed(0)
    with device:
        model = LoopLM(preset("ouro-1.4b", **size["model"]))
    model = model.to(torch.float32 if a.smoke else torch.bfloat16).eval()
    s, gen = sweep(model, size, device), generation(model, size, device)
    summary = [
        {"row": f"1.4B sweep T=1..8 + exit frontier over {s['tokens']:,} tokens: seconds", "measured": s["seconds"]},
        *({"row": f"1.4B greedy generation, batch {g['batch']}: tokens/s", "measured": g["tokens_per_s"]} for g in gen),
    ]
    machine = "CPU (smoke run)" if a.smoke else f"1 x {torch.cuda.get_device_name(0)}"
    doc = {
        "title": "Evaluation and generation speed", "torch": torch.__version__,
        "command": shlex.join(["python", "benchmarks/eval_speed.py", *argv]), "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "machine": f"{machine}, torch {torch.__version__}",
        "summary": [{"target": None, "met": None, **r} for r in summary],
        "tables": [{"title": "Generation (full KV cache, T = 4, greedy)",
                    "columns": ["batch", "tokens/s", "decode tokens/s", "prefill s"],
                    "rows": [[g["batch"], round(g["tokens_per_s"], 1), round(g["decode_tokens_per_s"], 1),
                              round(g["prefill_seconds"], 3)] for g in gen]}],
        "notes": ["Written by `benchmarks/eval_speed.py` (its --help says what it measures): a random-init ouro-1.4b "
                  "in bf16, random tokens."],
        "result": {"sizes": size, "sweep": s, "generation": gen},
    }  # fmt: skip
    a.out = out_path(a, machine)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=1) + "\n")
    print("\n".join(f"{r['row']}: {r['measured']:.4g}" for r in summary) + f"\nwrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
