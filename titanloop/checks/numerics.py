"""The numerical checks of the fast path, importable and device-agnostic: each returns a `Check` (name, PASS/FAIL,
one-line detail, the numbers its verdict came from). `python -m titanloop.checks` runs them on CUDA; tests/ runs them on
CPU, together with the broken variants each one must catch. Tolerances and their derivation: docs/scaling.md,
"GPU check".

    attention_check        bf16 attention as the model calls it vs a float64 reference on the same rounded inputs
    bf16_logits_check      a trained LoopLM's bf16 logits vs fp32, against the error of rounding only its weights
    compile_check          per-layer compile over T x document counts: 0 graph breaks, no recompiles
    readout_check          the per-loop readout (fused or recompute) in bf16 vs full fp32 logits, values and grads
    kernel_choice_check    the attention kernels a training run chose (recorded by `record_kernels`): fused bf16 CUDA
    fused_readout_comparison  fused vs recompute readout: error, seconds and peak memory (reported, not judged)
"""

from __future__ import annotations

import copy
import itertools
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch._dynamo
import torch.nn.functional as F
from torch._dynamo.utils import counters

from titanloop.model import LoopLM
from titanloop.model import attention as attn
from titanloop.model.attention import math_attention
from titanloop.model.config import LoopLMConfig, preset
from titanloop.objectives.chunked_ce import IGNORE_INDEX, fused_per_loop_cross_entropy, per_loop_cross_entropy
from titanloop.objectives.exit_distribution import exit_probs
from titanloop.parallel.compile import apply_compile, compiled_graphs

BF16_U = 2.0**-8  # unit roundoff of bfloat16 (8 significand bits): |round(x) - x| <= u |x|
# bf16 logits: a bf16 forward rounds the weights (what the reference measures) and, at each matmul, its input
# and output activations, plus the residual adds and norms: about 4 rounding sites of size u per weight rounding
# in a decoder layer, so the error may be up to ~4x the weights-only error if they add up in the same direction.
BF16_SITES = 4.0
READOUT_FACTOR = 2.0  # the readout may round at other points than the naive bf16 computation, not more often
MIN_LEARNED = 0.10  # a training run must lower its loss by this fraction before what it trained is judged
SLOW_KERNELS = ("sdpa_per_doc", "dense")  # fallbacks: a Python loop over documents / a materialized [S, S] mask


@dataclass
class Check:
    name: str
    ok: bool | None  # None: reported only (never counted as a pass)
    detail: str
    numbers: dict = field(default_factory=dict)  # what the verdict was computed from (written to the json)


def _rel(a, ref) -> float:
    return ((a.double() - ref.double()).norm() / ref.double().norm()).item()


def kernel_name(q, mask) -> str:
    """The kernel titanloop.model.attention runs for q (its dtype/device) and `mask`."""

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
    `bf16_logits_verdict`. The defaults are the configuration whose margins tests/test_checks_numerics.py measures
    on CPU (2 layers; with 4 layers, debug-small, the bf16 / weights-only ratio was 2.6 instead of 1.7: it grows
    with depth, so BF16_SITES is not claimed for deeper models)."""
    cfg = preset(preset_name, vocab_size=vocab_size)
    return bf16_logits_verdict(*train_fp32(cfg, device, steps, seq_len, batch, lr, seed), steps=steps)


def bf16_logits_verdict(model, b: dict, first: float, last: float, steps: int) -> Check:
    """The last-loop logits of the trained fp32 `model` on batch `b` (document masking on), computed in bf16 (with
    the attention kernel the model picks) vs fp32 (math kernel): relative error (Frobenius) <= BF16_SITES x the
    relative error of the fp32 model with only its weights rounded to bf16. Not judgeable (FAIL) if training did
    not lower the loss by MIN_LEARNED."""

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
    fused: bool = False,
    readout_fn=None,
    n_loops: int = 4,
    batch: int = 2,
    seq_len: int = 1024,
    hidden: int = 2048,
    vocab: int = 49152,
    seed: int = 0,
) -> Check:
    """The training readout on bf16 readouts and a bf16 LM head vs the exact result (full fp32 logits from the same
    bf16 inputs): the relative error of the per-token CE, of the readouts' gradient and of the head's gradient must
    each be <= READOUT_FACTOR x that of the naive bf16 computation (full bf16 logits, F.cross_entropy in fp32,
    autograd). 1 in 16 targets is ignore_index. The readout: `fused=True` is the default training path,
    objective.ce_backward = "fused" (fused_per_loop_cross_entropy, its gradient formed in the same pass as the
    loss, the upstream weights as its loop weights); otherwise `readout_fn` (default per_loop_cross_entropy, the
    "recompute" path) weighted after the fact."""

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
        if fn == "fused":
            total, ce = fused_per_loop_cross_entropy(leaves, head, targets, dloss)
        else:
            ce = fn(leaves, head, targets)
            total = (ce.float() * dloss).sum()
        total.backward()
        grads = [torch.zeros_like(x) if x.grad is None else x.grad for x in [*leaves, head]]  # None: no gradient
        return ce.detach().double(), torch.stack(grads[:-1]).double(), grads[-1].double()

    def naive(hs_, head, tg):
        logits = torch.stack(list(hs_)) @ head.t()
        return F.cross_entropy(
            logits.float().flatten(0, -2), tg.expand(logits.shape[:-1]).flatten(), reduction="none"
        ).view(logits.shape[:-1])

    exact = run(naive, lambda x: x.float())
    base = [_rel(a, e) for a, e in zip(run(naive, lambda x: x), exact)]
    got = [_rel(a, e) for a, e in zip(run("fused" if fused else readout_fn, lambda x: x), exact)]
    names = ("ce", "grad_readouts", "grad_head")
    ok = all(gt <= READOUT_FACTOR * bs + 1e-7 for gt, bs in zip(got, base))
    detail = ", ".join(f"{n} {gt:.1e} (naive bf16 {bs:.1e})" for n, gt, bs in zip(names, got, base))
    return Check(
        "readout fused" if fused else "readout",
        ok,
        f"rel err vs fp32: {detail}; tol {READOUT_FACTOR:g} x naive",
        {
            "rel_err": dict(zip(names, got)),
            "rel_err_naive_bf16": dict(zip(names, base)),
            "factor": READOUT_FACTOR,
            "shape": [n_loops, batch, seq_len, hidden, vocab],
        },
    )


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


# ----- the kernel recorder (installed inside a training worker) ------------------------------------------------
def record_kernels(records: list) -> None:
    """Record the attention kernel of every LoopLM forward: [kernel, compute dtype, device] appended to `records`
    when the forward builds its mask (LoopLM.rope_and_mask), outside the compiled layers, and in a function Dynamo
    does not trace (torch.compiler.disable), so that recording never guards or recompiles a compiled graph. The
    kernel is the one the mask's attention calls dispatch to (titanloop.model.attention)."""

    inner = LoopLM.rope_and_mask

    @torch.compiler.disable
    def note(input_ids, mask, dtype) -> None:
        q = torch.empty(0, dtype=dtype, device=input_ids.device)
        records.append([kernel_name(q, mask), str(dtype), input_ids.device.type])

    def rope_and_mask(self, input_ids, **kwargs):
        cos, sin, mask = inner(self, input_ids, **kwargs)
        note(input_ids, mask, cos.dtype)
        return cos, sin, mask

    LoopLM.rope_and_mask = rope_and_mask


def fused_readout_comparison(
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
    """Stage I's CE term, sum_t p(t) L^(t) over tokens, both ways on the same random readouts, LM head and gate
    logits (some labels ignored), with an upstream scale as gradient accumulation gives: `fused`
    (fused_per_loop_cross_entropy, objective.ce_backward = "fused", the default) and `recompute` (weights times
    per_loop_cross_entropy). Returns `max_rel_err` (loss and the gradients w.r.t. the readouts, the LM head and the
    gate logits: max |fused - recompute| / max |recompute|) and per path the median forward + backward seconds
    (synchronized) and, on CUDA, the peak allocated bytes of one step (None on CPU)."""
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
