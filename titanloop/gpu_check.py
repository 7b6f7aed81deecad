"""`python -m titanloop.gpu_check` (or scripts/gpu_check.sh): one acceptance check of the fast path on a CUDA
machine with 1-8 GPUs, ending in a PASS/FAIL table and benchmarks/results/gpu_check.json (rendered into
BENCHMARKS.md by `python -m benchmarks.report`); exit status 0 only if every check passes.

Checks, in order (tolerances and their derivation: docs/scaling.md, "GPU check"):
  flash-attn        flash_attn imports (optional: without it attention uses torch's kernels; n/a then)
  attention docs    document-masked attention as the model calls it (bf16, the kernel titanloop picks) vs a
                    float64 dense-mask reference on the same bf16-rounded q, k, v: max |err| <= attention_tolerance
  attention plain   the same for plain causal attention (no documents: flash-attn or SDPA's flash kernel)
  bf16 logits       a LoopLM trained 40 steps in fp32 on a previous-token task (document masking), then its
                    last-loop logits in bf16 vs fp32: relative error <= BF16_SITES x the error of rounding only its
                    weights to bf16 (measured on the same model and batch)
  kernel choice     a 1-step `torchrun -m titanloop.train` (FSDP2, bf16 params, fp32 reduce, compile, document
                    masking) with every attention call recorded: all in bf16 on CUDA, none on a fallback kernel
  compile           the per-layer compiled LoopLM (titanloop.parallel.compile) in bf16 with document masking,
                    forward + backward over T in (2, 4, 8, 3) x (1, 3, 7) documents: 0 graph breaks, no graph
                    compiled after the first forward (no recompiles across T or document counts)
  readout           titanloop.objectives.per_loop_cross_entropy (bf16) vs full fp32 logits: values and gradients
                    no further from the fp32 result than 2 x the naive bf16 full-logits computation is
  train T, prec.    `torchrun -m titanloop.train` on all local GPUs (FSDP2, bf16 params, fp32 reduce, compile,
                    per-loop activation checkpointing, document masking), STEPS steps at T=4 and T=8, in bf16
                    and with `--float8.recipe tensorwise` and `rowwise`: tokens/s/GPU, MFU (FLOPs from
                    LoopLMConfig.flops_per_token, every loop counted, vs the device's bf16 dense peak) and peak
                    memory
  memory plan       each run's peak memory (torch.cuda.max_memory_allocated) vs the memory plan of the same
                    arguments (titanloop.train.memory_plan): within MEMORY_PLAN_RTOL
  float8 loss       each float8 run's loss (mean of the last LOSS_WINDOW logged steps) within FLOAT8_LOSS_RTOL of
                    the bf16 run at the same T; not judgeable (FAIL) unless the bf16 run learned (loss fell by
                    at least MIN_LEARNED)
  float8 speed      tokens/s of the float8 run / the bf16 run: tensorwise must be >= 1.0 (it exists to be faster);
                    rowwise is reported only

The model is the Ouro 1.4B shape when the smallest free GPU memory allows it, else a smaller shape
(`pick_model`). Without CUDA it prints one line and exits 1. The logic that needs no GPU is tested on CPU
(tests/test_gpu_check.py, including the broken variants each numerical check catches); none of it has run on a
GPU in this repository yet.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import itertools
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from titanloop.model.config import LoopLMConfig, preset

ROOT = Path(__file__).resolve().parents[1]
RESULT_JSON = ROOT / "benchmarks" / "results" / "gpu_check.json"
TRAIN_CONFIG = ROOT / "train_configs" / "debug.toml"

BF16_U = 2.0**-8  # unit roundoff of bfloat16 (8 significand bits): |round(x) - x| <= u |x|
# bf16 logits: a bf16 forward rounds the weights (what the reference measures) and, at each matmul, its input
# and output activations, plus the residual adds and norms: about 4 rounding sites of size u per weight rounding
# in a decoder layer, so the error may be up to ~4x the weights-only error if they add up in the same direction.
BF16_SITES = 4.0
READOUT_FACTOR = 2.0  # the readout may round at other points than the naive bf16 computation, not more often
MEMORY_PLAN_RTOL = 0.15  # the plan's stated accuracy (tests/test_train_memory_plan.py checks it on CPU)
FLOAT8_LOSS_RTOL = 0.03  # float8 vs bf16 loss at the same step (a-priori allowance, see docs/scaling.md)
MIN_LEARNED = 0.10  # the bf16 run's loss must fall by this fraction, else float8 vs bf16 judges nothing
LOSS_WINDOW = 4  # logged steps averaged at the end of a run (log_freq 5: the last 20 steps)
STEPS = 100
LOG_FREQ = 5
RECIPES = ("bf16", "tensorwise", "rowwise")
SLOW_KERNELS = ("sdpa_per_doc", "dense")  # fallbacks: a Python loop over documents / a materialized [S, S] mask
GIB = 1024**3
# bf16 dense peak FLOP/s by device name (MFU is quoted against the bf16 peak for float8 runs too, as torchtitan)
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "GH200": 989e12, "A100": 312e12, "B200": 2250e12}
# (preset, overrides) from the largest down; bytes per parameter of training state per GPU (fp32 master + Adam
# moments, sharded over GPUs) plus a fixed activation allowance, see `pick_model`.
SHAPES = [("ouro-1.4b", {}), ("ouro-1.4b", {"n_layers": 12}), ("ouro-1.4b", {"n_layers": 4}), ("debug-small", {})]
ACTIVATION_ALLOWANCE = 16 * GIB


@dataclass
class Check:
    name: str
    ok: bool | None  # None: reported only (never counted as a pass)
    detail: str
    numbers: dict = field(default_factory=dict)  # what the verdict was computed from (written to the json)


@dataclass
class RunResult:
    """One training run of gpu_check: what its metrics.jsonl and memory plan say."""

    n_loops: int
    precision: str  # bf16 | tensorwise | rowwise
    error: str | None = None  # the run failed: its last line of stderr
    tokens_per_s_gpu: float | None = None
    mfu: float | None = None
    peak_gib: float | None = None
    plan_gib: float | None = None
    loss_first: float | None = None
    loss_last: float | None = None  # mean of the last LOSS_WINDOW logged steps


def no_cuda_message() -> str | None:
    """The one line printed without CUDA, or None when CUDA is available."""
    import torch

    if torch.cuda.is_available():
        return None
    return (
        "gpu_check: no CUDA device (torch.cuda.is_available() is False): run it on a machine with NVIDIA "
        "GPUs and a CUDA build of torch"
    )


def state_bytes(cfg: LoopLMConfig, n_gpus: int) -> float:
    """Training state per GPU: fp32 params + grads + two Adam moments (16 B/param), sharded by FSDP2, plus the
    looped stack held unsharded in bf16 (reshard_looped='never')."""
    looped = cfg.layer_params() * (cfg.n_layers + cfg.n_coda_layers)
    return 16 * cfg.param_count() / n_gpus + 2 * looped


def pick_model(free_bytes: float, n_gpus: int) -> tuple[str, dict]:
    """The largest shape in SHAPES whose training state plus ACTIVATION_ALLOWANCE fits in `free_bytes`."""
    for name, overrides in SHAPES:
        if state_bytes(preset(name, **overrides), n_gpus) + ACTIVATION_ALLOWANCE <= free_bytes:
            return name, overrides
    return SHAPES[-1]


def peak_flops(device_name: str) -> float | None:
    """The bf16 dense peak of a GPU by its name (torch.cuda.get_device_name), None when unknown."""
    for key in sorted(PEAK_FLOPS, key=len, reverse=True):  # GH200 before H200
        if key in device_name.upper():
            return PEAK_FLOPS[key]
    return None


def throughput(
    rows: list[dict], cfg: LoopLMConfig, seq_len: int, n_gpus: int, n_loops: int, peak: float | None
) -> tuple[float, float | None]:
    """(tokens/s/GPU, MFU) from metrics.jsonl rows of a run, skipping the first logged step (compilation)."""
    rows = [r for r in rows if r["step"] > 1] or rows
    tok_s = sum(r["tokens_per_s"] for r in rows) / len(rows)
    mfu = None if peak is None else tok_s * cfg.flops_per_token(seq_len, n_loops=n_loops) / (peak * n_gpus)
    return tok_s / n_gpus, mfu


# ----- commands --------------------------------------------------------------------------------------------
def train_args(
    run_dir: Path,
    name: str,
    overrides: dict,
    n_loops: int,
    seq_len: int,
    n_gpus: int,
    precision: str = "bf16",
    steps: int = STEPS,
) -> list[str]:
    """Overrides of TRAIN_CONFIG for one gpu_check training run (also what its memory plan is computed for).
    The copy task of train_configs/debug.toml at the Ouro vocabulary, AdamW at 1e-3 (debug.toml's 1e-2 is for its
    tiny model), per-loop activation checkpointing as every stage config (without it 1.4B at T=8, 4K needs 107 GB
    per GPU, benchmarks/results/memory_plan.json); `precision` bf16 adds nothing (training.dtype auto is bf16 on
    GPU), a float8 recipe adds `--float8.recipe <recipe>`."""
    if precision not in RECIPES:
        raise ValueError(f"precision {precision!r}: expected one of {RECIPES}")
    args = [
        "--model.vocab_size",
        "49152",
        "--training.run_dir",
        str(run_dir),
        "--training.steps",
        str(steps),
        "--training.seq_len",
        str(seq_len),
        "--training.micro_batch_size",
        "1",
        "--training.global_batch_size",
        str(n_gpus),
        "--model.preset",
        name,
        "--loop_sampler.n_loops",
        str(n_loops),
        "--optimizer.lr",
        "1e-3",
        "--lr_scheduler.warmup_steps",
        "10",
        "--parallelism.compile",
        "true",
        "--parallelism.activation_checkpoint",
        "loop",
        "--metrics.log_freq",
        str(LOG_FREQ),
        "--metrics.wandb",
        "off",
        "--checkpoint.enable",
        "false",
    ]
    for key, value in overrides.items():
        args += [f"--model.{key}", str(value)]
    if precision != "bf16":
        args += ["--float8.recipe", precision]
    return args


def torchrun_command(python: str, n_gpus: int, args: list[str], prefix: list[str] | None = None) -> list[str]:
    """`python -m torch.distributed.run ... -m <module>` for `args`: titanloop.train, or with `prefix`
    (e.g. the kernel recorder: ["-m", "titanloop.gpu_check", "--record-kernels", FILE]) another entry point."""
    entry = prefix or ["-m", "titanloop.train"]
    return [
        python,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={n_gpus}",
        *entry,
        "--config",
        str(TRAIN_CONFIG),
        *args,
    ]


def missing_modules(precision: str = "bf16") -> list[str]:
    """Modules a gpu_check training run needs that this interpreter cannot import (an existing interpreter given
    with --python may have torch but not the project's other dependencies)."""
    import importlib.util

    needed = ["torchtitan"] + (["torchao"] if precision != "bf16" else [])
    return [m for m in needed if importlib.util.find_spec(m) is None]


# ----- verdicts (no GPU needed) ------------------------------------------------------------------------------
def memory_plan_check(label: str, measured_gib: float | None, planned_gib: float | None) -> Check:
    """Measured peak vs planned peak (GiB): PASS within MEMORY_PLAN_RTOL of the plan."""
    numbers = {"measured_gib": measured_gib, "planned_gib": planned_gib, "rtol": MEMORY_PLAN_RTOL}
    if measured_gib is None or planned_gib is None:
        return Check(label, False, f"missing: measured {measured_gib}, planned {planned_gib}", numbers)
    rel = measured_gib / planned_gib - 1
    return Check(
        label,
        abs(rel) <= MEMORY_PLAN_RTOL,
        f"measured {measured_gib:.2f} GiB, planned {planned_gib:.2f} GiB ({100 * rel:+.0f}%, "
        f"tol {100 * MEMORY_PLAN_RTOL:.0f}%)",
        {**numbers, "rel": rel},
    )


def loss_window(rows: list[dict]) -> tuple[float, float]:
    """(first logged loss, mean loss of the last LOSS_WINDOW logged steps) of a run's metrics rows."""
    last = rows[-LOSS_WINDOW:]
    return rows[0]["loss"], sum(r["loss"] for r in last) / len(last)


def float8_checks(runs: list[RunResult]) -> list[Check]:
    """float8 vs bf16 at the same T: the loss (FLOAT8_LOSS_RTOL, judged only if bf16 learned) and tokens/s
    (tensorwise >= 1.0x; rowwise reported)."""
    checks = []
    bf16 = {r.n_loops: r for r in runs if r.precision == "bf16"}
    for r in runs:
        if r.precision == "bf16":
            continue
        label, base = f"float8 {r.precision} T={r.n_loops}", bf16.get(r.n_loops)
        if r.error or base is None or base.error:
            why = r.error or (f"no bf16 run at T={r.n_loops}" if base is None else f"bf16 run failed: {base.error}")
            checks.append(Check(f"{label} loss", False, why))
            continue
        learned = 1 - base.loss_last / base.loss_first
        rel = abs(r.loss_last - base.loss_last) / base.loss_last
        numbers = {
            "loss": r.loss_last,
            "bf16_loss": base.loss_last,
            "rel": rel,
            "rtol": FLOAT8_LOSS_RTOL,
            "bf16_learned": learned,
        }
        if learned < MIN_LEARNED:
            checks.append(
                Check(
                    f"{label} loss",
                    False,
                    f"not judgeable: the bf16 run's loss fell only "
                    f"{100 * learned:.0f}% ({base.loss_first:.3f} -> {base.loss_last:.3f}, needs "
                    f"{100 * MIN_LEARNED:.0f}%)",
                    numbers,
                )
            )
        else:
            checks.append(
                Check(
                    f"{label} loss",
                    rel <= FLOAT8_LOSS_RTOL,
                    f"{r.loss_last:.4f} vs bf16 {base.loss_last:.4f} (rel {100 * rel:.2f}%, tol "
                    f"{100 * FLOAT8_LOSS_RTOL:.0f}%)",
                    numbers,
                )
            )
        ratio = r.tokens_per_s_gpu / base.tokens_per_s_gpu
        rule = r.precision == "tensorwise"
        checks.append(
            Check(
                f"{label} speed",
                (ratio >= 1.0) if rule else None,
                f"{r.tokens_per_s_gpu:,.0f} vs bf16 {base.tokens_per_s_gpu:,.0f} tokens/s/GPU "
                f"({ratio:.2f}x{', needs >= 1.00x' if rule else ', reported only'})",
                {"ratio": ratio, "target": ">= 1.0" if rule else None},
            )
        )
    return checks


def kernel_choice_check(records: list[list[str]], label: str = "kernel choice") -> Check:
    """Attention calls recorded in a trainer run ([kernel, dtype, device] each, see `record_kernels`): PASS iff
    there are some and every one ran in bf16 on CUDA on a fused kernel (not one of SLOW_KERNELS)."""
    seen = sorted({tuple(r) for r in records})
    bad = [r for r in seen if r[1] != "torch.bfloat16" or r[2] != "cuda" or r[0] in SLOW_KERNELS]
    numbers = {"calls": len(records), "seen": [list(r) for r in seen]}
    if not records:
        return Check(label, False, "no attention call was recorded", numbers)
    text = ", ".join(f"{k} {d.removeprefix('torch.')} {dev}" for k, d, dev in seen)
    return Check(
        label, not bad, f"{len(records)} calls: {text}" + (f"; not fused bf16 CUDA: {bad}" if bad else ""), numbers
    )


def format_table(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = [f"{'check':<{width}}  result  detail", f"{'-' * width}  ------  ------"]
    for c in checks:
        lines.append(f"{c.name:<{width}}  {verdict(c):<6}  {c.detail}")
    return "\n".join(lines)


def verdict(c: Check) -> str:
    return "n/a" if c.ok is None else ("PASS" if c.ok else "FAIL")


def exit_status(checks: list[Check]) -> int:
    return 0 if all(c.ok is not False for c in checks) and any(c.ok for c in checks) else 1


# ----- the numerical checks: CUDA in gpu_check, CPU in the tests ---------------------------------------------
def _rel(a, ref) -> float:
    return ((a.double() - ref.double()).norm() / ref.double().norm()).item()


def kernel_name(q, mask) -> str:
    """The kernel titanloop.model.attention runs for q (its dtype/device) and `mask`."""
    # (lazy: without CUDA gpu_check answers in one line before torch and the trainer load)
    from titanloop.model import attention as attn

    if isinstance(mask, attn.DocumentMask):
        return mask.kernel
    if mask is not None:
        return "dense"
    half = str(q.dtype) in ("torch.bfloat16", "torch.float16")
    return "flash_attn" if attn.flash_available() and q.is_cuda and half else "sdpa_causal"


def attention_tolerance(ref, v) -> float:
    """Max |error| allowed for a bf16 attention kernel against an exact reference on the same bf16 inputs: the
    output is rounded once (u |out|) and the probabilities are rounded to bf16 before P @ V (at most u max|v|,
    since they sum to 1); x2 for the kernel's fp32 exp/rescaling and accumulation order."""
    return 2 * BF16_U * (ref.abs().max().item() + v.abs().max().item())


def attention_check(
    label: str,
    device: str,
    doc_ids=None,
    *,
    attention_fn=None,
    heads: int = 8,
    head_dim: int = 64,
    shape: tuple[int, int] = (2, 1024),
    seed: int = 0,
) -> Check:
    """Attention in bf16 as the model calls it (`attention_fn`, default titanloop.model.attention.attention with
    the mask the model builds) vs float64 SDPA with the dense causal (+ document) mask on the same rounded
    inputs. doc_ids [B, S] or None (plain causal). On CUDA the kernel must also not be a fallback."""
    import torch

    # (lazy: without CUDA gpu_check answers in one line before torch and the trainer load)
    from titanloop.model import attention as attn

    attention_fn = attention_fn or attn.attention
    b, s = doc_ids.shape if doc_ids is not None else shape
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, heads, s, head_dim, generator=g).to(device, torch.bfloat16) for _ in range(3))
    if doc_ids is not None:
        doc_ids = doc_ids.to(device)
    ref = attn.attention(q.double(), k.double(), v.double(), attn.causal_mask(s, s, device, doc_ids))
    mask = attn.document_mask(doc_ids, "auto", torch.bfloat16) if doc_ids is not None else None
    out = attention_fn(q, k, v, mask)
    err = (out.double() - ref).abs().max().item()
    tol = attention_tolerance(ref, v)
    kernel = kernel_name(q, mask)
    fused = not q.is_cuda or kernel not in SLOW_KERNELS
    return Check(
        label,
        err <= tol and fused,
        f"kernel {kernel}, max |err| {err:.2e} (tol {tol:.2e})",
        {"kernel": kernel, "max_abs_err": err, "tol": tol},
    )


def doc_ids_with(n_docs: int, batch: int, seq_len: int, seed: int = 0):
    """doc_ids [batch, seq_len] with `n_docs` documents per row at random boundaries (non-decreasing ids)."""
    import torch

    g = torch.Generator().manual_seed(seed + n_docs)
    rows = []
    for _ in range(batch):
        cuts = torch.randperm(seq_len - 1, generator=g)[: n_docs - 1].sort().values + 1
        row = torch.zeros(seq_len, dtype=torch.long)
        for c in cuts.tolist():
            row[c:] += 1
        rows.append(row)
    return torch.stack(rows)


def previous_token_batch(vocab_size: int, batch: int, seq_len: int, n_docs: int, seed: int) -> dict:
    """Random tokens in `n_docs` documents per row; the target at position i is the token at i - 1 of the same
    document (ignore_index at document starts): a task only attention solves, learned in a few dozen steps."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (batch, seq_len), generator=g)
    doc_ids = doc_ids_with(n_docs, batch, seq_len, seed)
    labels = torch.full_like(ids, -100)
    same = doc_ids[:, 1:] == doc_ids[:, :-1]
    labels[:, 1:] = torch.where(same, ids[:, :-1], torch.full_like(ids[:, 1:], -100))
    return {"input_ids": ids, "labels": labels, "doc_ids": doc_ids}


def train_fp32(cfg: LoopLMConfig, device: str, steps: int, seq_len: int, batch: int, lr: float, seed: int):
    """A LoopLM trained in fp32 on `previous_token_batch` (document masking on) for `steps` AdamW steps (mean
    per-loop CE, clipped at 1); returns (model, a held-out batch, first loss, mean of the last 5 losses)."""
    import torch

    # (lazy: without CUDA gpu_check answers in one line before torch and the trainer load)
    from titanloop.model import LoopLM
    from titanloop.objectives import per_loop_cross_entropy

    torch.manual_seed(seed)
    model = LoopLM(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)

    def get(i):
        b = previous_token_batch(cfg.vocab_size, batch, seq_len, 4, seed * 100_000 + i)
        return {k: v.to(device) for k, v in b.items()}

    losses = []
    for step in range(steps):
        b = get(step)
        out = model(b["input_ids"], doc_ids=b["doc_ids"])
        ce = per_loop_cross_entropy(out.readouts, model.lm_head.weight, b["labels"])
        loss = ce[:, b["labels"] != -100].mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return model.eval(), get(steps + 1000), losses[0], sum(losses[-5:]) / len(losses[-5:])


def bf16_logits_check(
    device: str,
    *,
    preset_name: str = "debug-tiny",
    vocab_size: int = 64,
    steps: int = 40,
    seq_len: int = 64,
    batch: int = 8,
    lr: float = 1e-2,
    seed: int = 0,
) -> Check:
    """Train a LoopLM for `steps` steps in fp32 on the previous-token task (`train_fp32`), then
    `bf16_logits_verdict`. The defaults are the configuration whose margins tests/test_gpu_check.py measures on CPU
    (2 layers; with 4 layers, debug-small, the bf16 / weights-only ratio was 2.6 instead of 1.7: it grows with
    depth, so BF16_SITES is not claimed for deeper models)."""
    cfg = preset(preset_name, vocab_size=vocab_size)
    return bf16_logits_verdict(*train_fp32(cfg, device, steps, seq_len, batch, lr, seed), steps=steps)


def bf16_logits_verdict(model, b: dict, first: float, last: float, steps: int) -> Check:
    """The last-loop logits of the trained fp32 `model` on batch `b` (document masking on), computed in bf16 (with
    the attention kernel the model picks) vs fp32 (math kernel): relative error (Frobenius) <= BF16_SITES x the
    relative error of the fp32 model with only its weights rounded to bf16. Not judgeable (FAIL) if training did
    not lower the loss by MIN_LEARNED."""
    import torch

    # (lazy: without CUDA gpu_check answers in one line before torch and the trainer load)
    from titanloop.model.attention import math_attention

    def logits(m):
        with torch.no_grad():
            return m(b["input_ids"], doc_ids=b["doc_ids"], return_logits="last").logits.float()

    with math_attention():  # the fp32 references on PyTorch's math kernel, whatever the device
        ref = logits(model)
        rounded = copy.deepcopy(model)
        with torch.no_grad():
            for p in rounded.parameters():
                p.copy_(p.bfloat16().float())
        e_w = _rel(logits(rounded), ref)
    e_b = _rel(logits(copy.deepcopy(model).bfloat16()), ref)  # the kernels training picks
    tol = BF16_SITES * e_w
    learned = 1 - last / first
    numbers = {
        "rel_err_bf16": e_b,
        "rel_err_weights_rounded": e_w,
        "tol": tol,
        "loss_first": first,
        "loss_last": last,
        "steps": steps,
    }
    detail = (
        f"rel err {e_b:.2e} vs tol {tol:.2e} ({BF16_SITES:g} x weights-only rounding {e_w:.2e}); "
        f"trained {steps} steps, loss {first:.3f} -> {last:.3f}"
    )
    if learned < MIN_LEARNED:
        return Check("bf16 logits", False, "not judgeable, training did not learn: " + detail, numbers)
    return Check("bf16 logits", e_b <= tol, detail, numbers)


def compile_check(
    device: str,
    *,
    dtype=None,
    backend: str = "inductor",
    preset_name: str = "debug-small",
    seq_len: int = 256,
    loops=(2, 4, 8, 3),
    doc_counts=(1, 3, 7),
    doc_masking: bool = True,
) -> Check:
    """The LoopLM with every decoder layer compiled as training compiles it (titanloop.parallel.compile), forward +
    backward for every T in `loops` and document count in `doc_counts`: PASS iff Dynamo counted 0 graph breaks
    and compiled no graph after the first forward (no recompiles across T or document counts)."""
    import torch
    import torch._dynamo
    from torch._dynamo.utils import counters

    # (lazy: without CUDA gpu_check answers in one line before torch and the trainer load)
    from titanloop.model import LoopLM
    from titanloop.parallel.compile import apply_compile, compiled_graphs

    dtype = dtype or torch.bfloat16
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = LoopLM(preset(preset_name)).to(device, dtype)
    apply_compile(model, backend)
    x = torch.randint(0, model.cfg.vocab_size, (2, seq_len), device=device)
    first = None
    combos = list(itertools.product(loops, doc_counts if doc_masking else (0,)))
    try:
        for t, n_docs in combos:
            doc_ids = doc_ids_with(n_docs, 2, seq_len).to(device) if doc_masking else None
            model(x, t, doc_ids=doc_ids).readouts[-1].float().mean().backward()
            first = compiled_graphs() if first is None else first
    except (torch._dynamo.exc.TorchDynamoException, torch._dynamo.exc.FailOnRecompileLimitHit) as e:  # fullgraph=True
        if isinstance(e, torch._dynamo.exc.FailOnRecompileLimitHit) or "recompile" in str(e).lower():
            counters["recompile_limit"][str(e).splitlines()[0]] += 1
        else:
            counters["graph_break"][f"fullgraph: {str(e).splitlines()[0]}"] += 1
        first = compiled_graphs() if first is None else first
    graphs = compiled_graphs() + sum(counters["recompile_limit"].values())  # a hit limit is recompiling
    reasons = counters["graph_break"]
    breaks = sum(reasons.values())
    top = "; ".join(f"{n} x {r.splitlines()[0][:80]}" for r, n in reasons.most_common(2))
    return Check(
        "compile",
        breaks == 0 and graphs == first,
        f"{breaks} graph breaks{f' ({top})' if top else ''}; {first} graphs after the first forward, "
        f"{graphs} after T in {list(loops)} x documents in {list(doc_counts) if doc_masking else 'none'}",
        {"graph_breaks": breaks, "graphs_first": first, "graphs_last": graphs, "break_reasons": dict(reasons)},
    )


def readout_check(
    device: str,
    *,
    readout_fn=None,
    n_loops: int = 4,
    batch: int = 2,
    seq_len: int = 1024,
    hidden: int = 2048,
    vocab: int = 49152,
    seed: int = 0,
) -> Check:
    """`readout_fn` (default titanloop.objectives.per_loop_cross_entropy) on bf16 readouts and a bf16 LM head vs
    the exact result (full fp32 logits from the same bf16 inputs): the relative error of the per-token CE, of the
    readouts' gradient and of the head's gradient must each be <= READOUT_FACTOR x that of the naive bf16
    computation (full bf16 logits, F.cross_entropy in fp32, autograd). 1 in 16 targets is ignore_index."""
    import torch
    import torch.nn.functional as F

    # (lazy: without CUDA gpu_check answers in one line before torch and the trainer load)
    from titanloop.objectives import per_loop_cross_entropy

    readout_fn = readout_fn or per_loop_cross_entropy
    g = torch.Generator().manual_seed(seed)
    # readouts at unit RMS (the final norm's output), a head giving logits of std ~2 (a trained model's range)
    hs = [torch.randn(batch, seq_len, hidden, generator=g).to(device, torch.bfloat16) for _ in range(n_loops)]
    w = (torch.randn(vocab, hidden, generator=g) * 2 / hidden**0.5).to(device, torch.bfloat16)
    targets = torch.randint(0, vocab, (batch, seq_len), generator=g)
    targets[:, ::16] = -100
    targets = targets.to(device)
    dloss = torch.rand(n_loops, batch, seq_len, generator=g).to(device)  # weights the loops/tokens differently

    def run(fn, cast):
        leaves = [cast(h).detach().requires_grad_() for h in hs]
        head = cast(w).detach().requires_grad_()
        ce = fn(leaves, head, targets)
        (ce.float() * dloss).sum().backward()
        grads = [torch.zeros_like(x) if x.grad is None else x.grad for x in [*leaves, head]]  # None: no gradient
        return ce.detach().double(), torch.stack(grads[:-1]).double(), grads[-1].double()

    def naive(hs_, head, tg):
        logits = torch.stack(list(hs_)) @ head.t()
        return F.cross_entropy(
            logits.float().flatten(0, -2), tg.expand(logits.shape[:-1]).flatten(), reduction="none"
        ).view(logits.shape[:-1])

    exact = run(naive, lambda x: x.float())
    base = [_rel(a, e) for a, e in zip(run(naive, lambda x: x), exact)]
    got = [_rel(a, e) for a, e in zip(run(readout_fn, lambda x: x), exact)]
    names = ("ce", "grad_readouts", "grad_head")
    ok = all(gt <= READOUT_FACTOR * bs + 1e-7 for gt, bs in zip(got, base))
    detail = ", ".join(f"{n} {gt:.1e} (naive bf16 {bs:.1e})" for n, gt, bs in zip(names, got, base))
    return Check(
        "readout",
        ok,
        f"rel err vs fp32: {detail}; tol {READOUT_FACTOR:g} x naive",
        {
            "rel_err": dict(zip(names, got)),
            "rel_err_naive_bf16": dict(zip(names, base)),
            "factor": READOUT_FACTOR,
            "shape": [n_loops, batch, seq_len, hidden, vocab],
        },
    )


# ----- the kernel recorder (runs inside a torchrun worker) -----------------------------------------------------
def record_kernels(records: list) -> None:
    """Wrap the attention call of titanloop.model.looplm so that every call appends [kernel, q dtype, device]."""
    # (lazy: without CUDA gpu_check answers in one line before torch and the trainer load)
    from titanloop.model import looplm

    inner = looplm.attention

    def recorded(q, k, v, mask, *args, **kwargs):
        records.append([kernel_name(q, mask), str(q.dtype), q.device.type])
        return inner(q, k, v, mask, *args, **kwargs)

    looplm.attention = recorded


def record_kernels_main(out: str, train_argv: list[str]) -> int:
    """`torchrun ... -m titanloop.gpu_check --record-kernels OUT --config ... [overrides]`: the trainer's own
    main with the recorder installed; rank 0 writes the records to OUT."""
    # (lazy: without CUDA gpu_check answers in one line before torch and the trainer load)
    from titanloop.train.__main__ import main as train_main

    records: list = []
    record_kernels(records)
    code = train_main(train_argv)
    if os.environ.get("RANK", "0") == "0":
        Path(out).write_text(json.dumps(records))
    return code


# ----- the CUDA-only orchestration (not run in CI: no GPU) -----------------------------------------------------
def _check_flash() -> Check:
    # (lazy: without CUDA gpu_check answers in one line before torch and the trainer load)
    from titanloop.model.attention import flash_available

    if flash_available():
        return Check("flash-attn", True, "importable")
    return Check(
        "flash-attn",
        None,
        "not installed (optional: attention uses torch's kernels; pip install 'titanloop[gpu]' where a wheel exists)",
    )


def _check_kernel_choice(workdir: Path, name: str, overrides: dict) -> Check:
    out = workdir / "kernels.json"
    if missing_modules():
        return Check("kernel choice", False, f"{sys.executable} cannot import {missing_modules()}")
    args = train_args(workdir / "kernels", name, {**overrides, "n_layers": 2}, 4, 1024, 1, steps=1)
    cmd = torchrun_command(sys.executable, 1, args, ["-m", "titanloop.gpu_check", "--record-kernels", str(out)])
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not out.is_file():
        return Check("kernel choice", False, f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}")
    return kernel_choice_check(json.loads(out.read_text()))


def _train(
    n_gpus: int,
    name: str,
    overrides: dict,
    n_loops: int,
    seq_len: int,
    precision: str,
    workdir: Path,
    peak: float | None,
) -> tuple[RunResult, list[Check]]:
    run_dir = workdir / f"T{n_loops}-{precision}"
    args = train_args(run_dir, name, overrides, n_loops, seq_len, n_gpus, precision)
    label = f"train T={n_loops} {precision}"
    missing = missing_modules(precision)
    why = f"{sys.executable} cannot import {missing}" if missing else None
    if why:
        return RunResult(n_loops, precision, error=why), [Check(label, False, why)]
    proc = subprocess.run(torchrun_command(sys.executable, n_gpus, args), capture_output=True, text=True)
    if proc.returncode != 0:
        why = f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}"
        return RunResult(n_loops, precision, error=why), [Check(label, False, why)]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    cfg = preset(name, **overrides, n_loops=n_loops)
    tok_s, mfu = throughput(rows, cfg, seq_len, n_gpus, n_loops, peak)
    first, last = loss_window(rows)
    res = RunResult(
        n_loops,
        precision,
        tokens_per_s_gpu=tok_s,
        mfu=mfu,
        loss_first=first,
        loss_last=last,
        peak_gib=max(r.get("max_mem_gib") or 0 for r in rows) or None,
    )
    checks = [
        Check(
            label,
            True,
            f"{name} {overrides or ''} {tok_s:,.0f} tokens/s/GPU, MFU "
            f"{'n/a' if mfu is None else f'{100 * mfu:.1f}%'}, loss {first:.3f} -> {last:.3f}",
            {k: v for k, v in asdict(res).items() if k not in ("n_loops", "precision", "error")},
        )
    ]
    try:
        res.plan_gib = planned_peak_gib(TRAIN_CONFIG, args, n_gpus)
    except Exception as e:  # noqa: BLE001 - reported as a FAIL row
        return res, checks + [
            Check(f"memory plan T={n_loops} {precision}", False, f"plan failed: {type(e).__name__}: {e}"[:200])
        ]
    return res, checks + [memory_plan_check(f"memory plan T={n_loops} {precision}", res.peak_gib, res.plan_gib)]


def planned_peak_gib(config: Path, args: list[str], n_gpus: int) -> float:
    """The memory plan's peak (GiB per GPU) of `config` + `args` at `n_gpus` ranks (fake backend, meta tensors)."""
    # (lazy: without CUDA gpu_check answers in one line before torch and the trainer load)
    from titanloop.train.config import load_config
    from titanloop.train.dry_run import dry_run

    cfg = load_config(config, args, world_size=n_gpus)
    return dry_run(cfg, n_gpus, memory_plan=True).memory_plan.peak / GIB


# ----- the result json ---------------------------------------------------------------------------------------
def git_commit() -> str:
    """HEAD of this checkout, with '+dirty' when tracked files differ from it; 'unknown' outside git."""
    try:
        head = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def result_json(
    checks: list[Check],
    runs: list[RunResult],
    *,
    device: str,
    n_gpus: int,
    torch_version: str,
    commit: str,
    shape: str,
    seq_len: int,
    date: str | None = None,
) -> dict:
    """The benchmarks/results/gpu_check.json document (the schema of benchmarks.report)."""
    date = date or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    passed = sum(1 for c in checks if c.ok)
    judged = sum(1 for c in checks if c.ok is not None)
    summary = [
        {
            "row": "gpu_check: checks passed",
            "measured": f"{passed}/{judged}",
            "target": "all",
            "met": passed == judged and judged > 0,
        }
    ]
    by = {(r.n_loops, r.precision): r for r in runs}
    base = by.get((4, "bf16"))
    if base is not None and base.error is None:
        summary.append(
            {
                "row": f"tokens/s/GPU, T=4, bf16 ({shape}, {seq_len} tokens)",
                "measured": round(base.tokens_per_s_gpu),
                "target": None,
                "met": None,
            }
        )
        if base.mfu is not None:
            summary.append({"row": "MFU, T=4, bf16", "measured": round(base.mfu, 4), "target": None, "met": None})
        f8 = by.get((4, "tensorwise"))
        if f8 is not None and f8.error is None:
            ratio = round(f8.tokens_per_s_gpu / base.tokens_per_s_gpu, 3)
            summary.append(
                {
                    "row": "float8 tensorwise / bf16 tokens/s, T=4",
                    "measured": ratio,
                    "target": ">= 1.0",
                    "met": ratio >= 1.0,
                }
            )

    def fmt(x, spec):
        return "" if x is None else format(x, spec)

    run_rows = [
        [
            r.n_loops,
            r.precision,
            fmt(r.tokens_per_s_gpu, ",.0f"),
            fmt(r.mfu and 100 * r.mfu, ".1f"),
            fmt(r.peak_gib, ".2f"),
            fmt(r.plan_gib, ".2f"),
            "" if r.loss_first is None else f"{r.loss_first:.3f} -> {r.loss_last:.3f}",
            r.error or "",
        ]
        for r in runs
    ]
    tables = [
        {
            "title": "Checks",
            "columns": ["check", "result", "detail"],
            "rows": [[c.name, verdict(c), c.detail] for c in checks],
        }
    ]
    if runs:
        tables.append(
            {
                "title": f"Training runs ({shape}, {seq_len} tokens/sequence, 1 sequence per GPU, {STEPS} "
                "steps, FSDP2 + compile + per-loop AC + document masking)",
                "columns": [
                    "T",
                    "precision",
                    "tokens/s/GPU",
                    "MFU %",
                    "peak GiB",
                    "plan GiB",
                    f"loss first -> last {LOSS_WINDOW} logged",
                    "error",
                ],
                "rows": run_rows,
            }
        )
    return {
        "title": "GPU check: the fast path on CUDA",
        "order": 5,
        "command": "bash scripts/gpu_check.sh",
        "date": date,
        "machine": f"{n_gpus} x {device}, torch {torch_version}",
        "commit": commit,
        "summary": summary,
        "tables": tables,
        "notes": [
            "Written by `scripts/gpu_check.sh` (titanloop/gpu_check.py); the tolerances and their derivation "
            "are in docs/scaling.md. MFU is against the device's bf16 dense peak, float8 runs included."
        ],
        "result": {
            "device": device,
            "n_gpus": n_gpus,
            "torch": torch_version,
            "commit": commit,
            "shape": shape,
            "seq_len": seq_len,
            "checks": [asdict(c) for c in checks],
            "runs": [asdict(r) for r in runs],
        },
    }


def write_json(path: Path, doc: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    os.replace(tmp, path)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m titanloop.gpu_check", description=__doc__.split("\n")[0])
    parser.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence of the training runs")
    parser.add_argument("--loops", default="4,8", help="T of the training runs (comma-separated, default 4,8)")
    parser.add_argument(
        "--precisions",
        default=",".join(RECIPES),
        help=f"training runs' precisions, a subset of {','.join(RECIPES)} (default all)",
    )
    parser.add_argument("--skip-train", action="store_true", help="only the single-GPU checks")
    parser.add_argument("--out", type=Path, default=RESULT_JSON, help="result json (default %(default)s)")
    parser.add_argument("--no-json", action="store_true", help="print the table only")
    args = parser.parse_args(argv)
    try:
        args.loops = [int(t) for t in args.loops.split(",")]
        assert all(t >= 1 for t in args.loops)
    except (ValueError, AssertionError):
        parser.error(f"--loops {args.loops!r}: expected comma-separated integers >= 1, e.g. --loops 4,8")
    args.precisions = args.precisions.split(",")
    bad = [p for p in args.precisions if p not in RECIPES]
    if bad:
        parser.error(f"--precisions: {bad} unknown, expected a subset of {','.join(RECIPES)}")
    if "bf16" not in args.precisions and not args.skip_train:
        parser.error("--precisions must include bf16: float8 runs are judged against the bf16 run")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--record-kernels"]:  # inside a torchrun worker (see _check_kernel_choice)
        return record_kernels_main(argv[1], argv[2:])
    args = parse_args(argv)
    message = no_cuda_message()
    if message:
        print(message)
        return 1
    import torch

    n_gpus = torch.cuda.device_count()
    device = torch.cuda.get_device_name(0)
    free = min(torch.cuda.mem_get_info(i)[0] for i in range(n_gpus))
    name, overrides = pick_model(free, n_gpus)
    doc_ids = torch.tensor([[0] * 300 + [1] * 700 + [2] * 24, [0] * 1024])
    single = [
        ("flash-attn", _check_flash),
        ("attention docs", lambda: attention_check("attention docs", "cuda", doc_ids)),
        ("attention plain", lambda: attention_check("attention plain", "cuda")),
        ("bf16 logits", lambda: bf16_logits_check("cuda")),
        ("compile", lambda: compile_check("cuda")),
        ("readout", lambda: readout_check("cuda")),
    ]
    checks, runs = [], []
    for label, fn in single:
        try:
            checks.append(fn())
        except Exception as e:  # noqa: BLE001 - a failing check is a FAIL row, the others still run
            checks.append(Check(label, False, f"{type(e).__name__}: {e}"[:200]))
        print(format_table(checks[-1:]).splitlines()[-1], flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        checks.append(_check_kernel_choice(Path(tmp), name, overrides))
        if not args.skip_train:
            for n_loops, precision in itertools.product(args.loops, args.precisions):
                res, rows = _train(
                    n_gpus, name, overrides, n_loops, args.seq_len, precision, Path(tmp), peak_flops(device)
                )
                runs.append(res)
                checks += rows
                print(format_table(rows).splitlines()[-1], flush=True)
    checks += float8_checks(runs)
    print(f"{n_gpus} x {device}, smallest free memory {free / GIB:.1f} GiB, torch {torch.__version__}")
    print(format_table(checks))
    if not args.no_json:
        shape = name + "".join(f" {k}={v}" for k, v in overrides.items())
        write_json(
            args.out,
            result_json(
                checks,
                runs,
                device=device,
                n_gpus=n_gpus,
                torch_version=torch.__version__,
                commit=git_commit(),
                shape=shape,
                seq_len=args.seq_len,
            ),
        )
        print(f"wrote {args.out}")
    return exit_status(checks)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    code = main()
    if sys.argv[1:2] == ["--record-kernels"]:
        from titanloop.train.process_exit import exit_without_teardown

        exit_without_teardown(code)  # as titanloop.train leaves (its native threads may abort a normal teardown)
    sys.exit(code)
