"""One call that checks the fused per-loop readout on a device: `check_fused_readout(device="cuda")`.

It runs Stage I's CE term, Σ_t p(t) L^(t) averaged over tokens, both ways on the same random readouts, LM head
and gate logits (some labels ignored), with an upstream scale as gradient accumulation gives:

    fused      fused_per_loop_cross_entropy (objective.ce_backward = "fused", the default)
    recompute  (w * per_loop_cross_entropy(...)).sum() (objective.ce_backward = "recompute")

and returns a dict: `max_rel_err` (loss, and the gradients w.r.t. the readouts, the LM head and the gate logits,
each as max |fused − recompute| / max |recompute|), and per path the median forward+backward seconds
(`seconds`, synchronized) and, on CUDA, the peak allocated bytes of one step (`peak_bytes`, None on CPU).
titanloop.gpu_check can call it on CUDA at a training shape in bf16; the CPU logic is tested in
tests/test_fused_readout.py.
"""

from __future__ import annotations

import statistics
import time

import torch

from titanloop.objectives.chunked_ce import IGNORE_INDEX, fused_per_loop_cross_entropy, per_loop_cross_entropy
from titanloop.objectives.exit_distribution import exit_probs


def check_fused_readout(
    device="cuda",
    dtype=torch.bfloat16,
    loops: int = 4,
    batch: int = 2,
    seq_len: int = 2048,
    hidden: int = 2048,
    vocab: int = 49152,
    chunk_size: int = 4096,
    repeats: int = 5,
    seed: int = 0,
) -> dict:
    device = torch.device(device)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    readouts = [
        torch.randn(batch, seq_len, hidden, generator=gen).to(device, dtype).requires_grad_(True) for _ in range(loops)
    ]
    head = (torch.randn(vocab, hidden, generator=gen) * hidden**-0.5).to(device, dtype).requires_grad_(True)
    gates = torch.randn(loops, batch, seq_len, generator=gen).to(device).requires_grad_(True)
    labels = torch.randint(0, vocab, (batch, seq_len), generator=gen)
    labels[:, ::7] = IGNORE_INDEX
    labels = labels.to(device)
    mask = (labels != IGNORE_INDEX).float()
    leaves = readouts + [head, gates]
    upstream = 1.0 / 3.0  # as 1 / accum with 3 micro-batches

    def loss_of(path: str) -> torch.Tensor:
        w = exit_probs(gates) * mask / mask.sum()
        if path == "fused":
            return fused_per_loop_cross_entropy(readouts, head, labels, w, chunk_size)[0]
        return (w * per_loop_cross_entropy(readouts, head, labels, chunk_size)).sum()

    def step(path: str):
        for x in leaves:
            x.grad = None
        loss = loss_of(path)
        (loss * upstream).backward()
        return loss.detach(), [x.grad for x in leaves]

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    out: dict = {
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "loops": loops,
        "tokens": batch * seq_len,
        "hidden": hidden,
        "vocab": vocab,
        "chunk_size": chunk_size,
        "seconds": {},
        "peak_bytes": {},
    }
    results = {}
    for path in ("recompute", "fused"):
        step(path)  # warm-up
        sync()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        results[path] = step(path)
        sync()
        out["peak_bytes"][path] = (torch.cuda.max_memory_allocated(device) - base) if device.type == "cuda" else None
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            step(path)
            sync()
            times.append(time.perf_counter() - t0)
        out["seconds"][path] = statistics.median(times)
    (loss_f, grads_f), (loss_r, grads_r) = results["fused"], results["recompute"]

    def rel(a, b):
        return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))

    out["max_rel_err"] = {
        "loss": rel(loss_f, loss_r),
        "readouts": max(rel(a, b) for a, b in zip(grads_f[:loops], grads_r[:loops])),
        "lm_head": rel(grads_f[loops], grads_r[loops]),
        "gate": rel(grads_f[-1], grads_r[-1]),
    }
    return out
