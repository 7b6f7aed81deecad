"""Ouroboros retrofit on CPU in minutes: pretrain a small dense Qwen2, retrofit it, compare the paper's variants.

    PYTHONPATH=. python experiments/ouroboros_retrofit/run.py [--out experiments/ouroboros_retrofit/results.json]

1. Pretrain a dense 8-layer Qwen2 (transformers' Qwen2ForCausalLM, hidden 64) on a 50/50 mix of two synthetic
   "domains" sharing one vocabulary, and save it in the HF layout (save_pretrained, safetensors):
     A  titanloop's synthetic_text (repeated random motifs: induction/copying)      in-distribution
     B  a fixed random sparse Markov chain (each token has 3 possible successors)      held-out
2. Retrofit it with titanloop.retrofit (P=2, R=4, C=2: layers 2, 3, 5 removed, their residuals seed the LoRA
   bases) and train only the extras on domain A: Controller vs static per-step LoRA vs no LoRA, gated vs
   ungated, depth 1/4/8, plus the paper's whole-sequence pooling vs causal pooling.
3. Report cross-entropy on fresh domain-A rows (in-distribution) and domain-B rows (held-out), beside the
   full dense model and the truncated 5-layer model with no training (the paper's "17-layer baseline").

The retrofit runs use a plain single-process AdamW loop on the RetrofitLM (the same model and freezing the
trainer uses; `torchrun -m titanloop.train --config train_configs/ouroboros_retrofit.toml` is tested in
tests/test_retrofit_train.py): 13 torchrun launches would cost minutes of start-up on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from titanloop.data.synthetic_text import SyntheticTextSource
from titanloop.retrofit import RetrofitConfig
from titanloop.retrofit.hf_import import load_retrofit

VOCAB, SEQ, LAYERS = 128, 64, 8
SPLIT = {"n_prelude": 2, "recurrent_layer": 4, "n_coda": 2}


class MarkovSource:
    """Domain B: a fixed random sparse chain; token t+1 is one of 3 successors of token t (p = .6/.3/.1)."""

    def __init__(self, seed: int):
        rng = np.random.default_rng(seed)
        self.succ = rng.integers(1, VOCAB, size=(VOCAB, 3))
        self.p = np.array([0.6, 0.3, 0.1])

    def row(self, k: int) -> np.ndarray:
        rng = np.random.default_rng([7, k])
        x = [int(rng.integers(1, VOCAB))]
        choice = rng.choice(3, size=SEQ + 1, p=self.p)
        while len(x) < SEQ + 1:
            x.append(int(self.succ[x[-1], choice[len(x)]]))
        return np.array(x)


TEXT = SyntheticTextSource(SEQ, VOCAB, seed=0, max_doc_len=48)
MARKOV = MarkovSource(seed=0)


def batch(source: str, start: int, n: int) -> torch.Tensor:
    rows = [TEXT.row(start + i).tokens if source == "A" else MARKOV.row(start + i) for i in range(n)]
    return torch.tensor(np.stack(rows), dtype=torch.long)


EVAL = {"in_dist": batch("A", 10_000_000, 64), "held_out": batch("B", 10_000_000, 64)}


def ce(logits: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), x[:, 1:].flatten())


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def pretrain(out_dir: Path, steps: int) -> dict:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=192,
                                         num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=SEQ, tie_word_embeddings=False))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, 3e-3, 50)
        x = torch.cat([batch("A", step * 8, 8), batch("B", step * 8, 8)])
        loss = ce(model(x).logits, x)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    model.eval()
    model.save_pretrained(out_dir)
    with torch.no_grad():
        return {k: float(ce(model(x).logits, x)) for k, x in EVAL.items()}


@torch.no_grad()
def evaluate(model, n_loops: int) -> dict:
    model.eval()
    return {k: float(ce(model(x, n_loops, return_logits="last").logits, x)) for k, x in EVAL.items()}


def retrofit_run(hf_dir: Path, steps: int, **kw) -> dict:
    cfg = RetrofitConfig(hf_path=str(hf_dir), **SPLIT, lora_rank=8, lora_alpha=16.0, style_dim=16, max_loops=8, **kw)
    torch.manual_seed(0)
    model = load_retrofit(cfg)
    trainable, frozen = model.param_counts()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.05)
    start, cpu = time.perf_counter(), time.process_time()
    for step in range(steps):
        model.train()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, 1e-3, 20)
        x = batch("A", 1_000_000 + step * 16, 16)
        loss = ce(model(x, return_logits="last").logits, x)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
    return {**kw, "trainable": trainable, "frozen": frozen, "train_s": round(time.perf_counter() - start, 1),
            "train_cpu_s": round(time.process_time() - cpu, 1),
            **evaluate(model, cfg.n_loops)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).with_name("results.json")))
    ap.add_argument("--pretrain-steps", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--hf-dir", default=None, help="reuse a pretrained dense model (skips pretraining)")
    args = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    t0, cpu0 = time.perf_counter(), time.process_time()
    hf_dir = Path(args.hf_dir or tempfile.mkdtemp(prefix="dense_qwen2_"))
    dense = pretrain(hf_dir, args.pretrain_steps) if args.hf_dir is None else None
    print(f"dense 8-layer Qwen2 ({time.perf_counter() - t0:.0f}s): {dense}", flush=True)
    base = evaluate(load_retrofit(RetrofitConfig(hf_path=str(hf_dir), **SPLIT, modulation="none",
                                                 gated_recurrence=False, step_norm=False)), 1)
    print(f"truncated 5-layer model, no training: {base}", flush=True)
    grid = [dict(modulation=m, gated_recurrence=True, n_loops=t) for m in ("controller", "static", "none")
            for t in (1, 4, 8)]
    grid += [dict(modulation="controller", gated_recurrence=False, n_loops=t) for t in (1, 4, 8)]
    grid += [dict(modulation="controller", gated_recurrence=True, n_loops=4, pooling="sequence")]
    runs = []
    for kw in grid:
        kw.setdefault("pooling", "causal")
        r = retrofit_run(hf_dir, args.steps, **kw)
        runs.append(r)
        print(json.dumps(r), flush=True)
    result = {"command": "python experiments/ouroboros_retrofit/run.py " + " ".join(argv or sys.argv[1:]),
              "vocab": VOCAB, "seq_len": SEQ, "dense_layers": LAYERS, "split": SPLIT,
              "pretrain_steps": args.pretrain_steps, "retrofit_steps": args.steps, "dense": dense,
              "truncated_untrained": base, "runs": runs, "total_s": round(time.perf_counter() - t0, 1),
              "total_cpu_s": round(time.process_time() - cpu0, 1)}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out} in {result['total_s']}s ({result['total_cpu_s']} CPU s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
