"""titanloop.checks.numerics on CPU tensors, each check next to the broken variant it must catch: zeroed or
unmasked attention in the bf16 path, a readout that loses loops' gradients (fused or not), a compiled layer with a
graph break or recompiles; and the kernel recorder inside a compiled training run."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from launch import environment

from titanloop.checks import numerics as nx
from titanloop.checks import runs
from titanloop.model import attention as attn
from titanloop.model import looplm, preset
from titanloop.objectives import per_loop_cross_entropy
from titanloop.train.launch import torchrun

ROOT = Path(__file__).resolve().parent.parent


# ----- the numerical checks on CPU tensors, with the broken variants they catch -----------------------------
DOCS = torch.tensor([[0] * 100 + [1] * 150 + [2] * 6, [0] * 256])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_attention_checks_pass_on_cpu_bf16(seed):
    for doc_ids in (DOCS, None):
        c = nx.attention_check("a", "cpu", doc_ids, shape=(2, 256), seed=seed)
        print(c.detail)
        assert c.ok, c.detail
        assert c.numbers["max_abs_err"] < c.numbers["tol"] / 4  # measured 7.4e-3 .. 8.0e-3 vs tol ~6e-2


def test_attention_checks_catch_a_dropped_mask_and_non_causal_attention():
    no_docs = nx.attention_check("a", "cpu", DOCS, attention_fn=lambda q, k, v, m: attn.attention(q, k, v, None))
    non_causal = nx.attention_check(
        "a", "cpu", shape=(2, 256), attention_fn=lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v)
    )
    for c in (no_docs, non_causal):
        assert c.ok is False and c.numbers["max_abs_err"] > 10 * c.numbers["tol"], c.detail


@pytest.fixture(scope="module")
def trained():
    """debug-tiny trained 40 steps in fp32 on the previous-token task (document masking): ~20 s on 2 cores."""
    return nx.train_fp32(preset("debug-tiny", vocab_size=64), "cpu", 40, 64, 8, 1e-2, 0)


def test_bf16_logits_of_a_trained_model(trained):
    _, _, first, last = trained
    assert last < 0.7 * first  # it learned (measured 4.17 -> 2.66 at seed 0; 1.78, 1.29 at seeds 1, 2)
    c = nx.bf16_logits_verdict(*trained, steps=40)
    print(c.detail)
    assert c.ok, c.detail  # measured rel err 1.05e-2 vs tol 2.49e-2 (seed 0; seeds 1, 2: 8.2e-3/1.9e-2, 7.4e-3/1.7e-2)


@pytest.mark.parametrize("broken", ["zero attention", "no document mask"])
def test_bf16_logits_catch_a_broken_bf16_attention(trained, monkeypatch, broken):
    """The bf16 path alone is broken (the fp32 reference and the weights-only rounding stay right)."""
    inner = looplm.attention

    def bad(q, k, v, mask, *args):
        if q.dtype != torch.bfloat16:
            return inner(q, k, v, mask, *args)
        return torch.zeros_like(q) if broken == "zero attention" else inner(q, k, v, None, *args)

    monkeypatch.setattr(looplm, "attention", bad)
    c = nx.bf16_logits_verdict(*trained, steps=40)
    print(c.detail)
    assert c.ok is False and c.numbers["rel_err_bf16"] > 5 * c.numbers["tol"], c.detail


def test_bf16_logits_untrained_is_not_judged():
    model, b, _, _ = nx.train_fp32(preset("debug-tiny", vocab_size=64), "cpu", 1, 64, 8, 1e-2, 0)
    c = nx.bf16_logits_verdict(model, b, 4.2, 4.1, steps=1)
    assert c.ok is False and c.detail.startswith("not judgeable")


def test_previous_token_batch():
    b = nx.previous_token_batch(64, 2, 32, 4, seed=0)
    starts = torch.ones_like(b["doc_ids"], dtype=torch.bool)
    starts[:, 1:] = b["doc_ids"][:, 1:] != b["doc_ids"][:, :-1]
    assert int(starts.sum()) == 8  # 4 documents per row
    assert (b["labels"][starts] == -100).all()
    assert torch.equal(b["labels"][:, 1:][~starts[:, 1:]], b["input_ids"][:, :-1][~starts[:, 1:]])


READOUT = dict(n_loops=4, batch=2, seq_len=128, hidden=64, vocab=512)


def test_readout_matches_full_logits():
    c = nx.readout_check("cpu", **READOUT)
    print(c.detail)
    assert c.ok, c.detail


def _last_loop_grad_only(rs, w, tg):
    rs = list(rs)
    return per_loop_cross_entropy([r.detach() for r in rs[:-1]] + rs[-1:], w, tg)


def _head_grad_from_last_loop(rs, w, tg):
    rs = list(rs)
    return torch.cat([per_loop_cross_entropy(rs[:-1], w.detach(), tg), per_loop_cross_entropy(rs[-1:], w, tg)])


def _bf16_log_softmax(rs, w, tg):
    lp = torch.log_softmax(torch.stack(list(rs)) @ w.t(), -1)  # the softmax in bf16
    ce = -lp.gather(-1, tg.clamp(min=0).expand(lp.shape[:-1])[..., None]).squeeze(-1).float()
    return torch.where(tg.expand(ce.shape) == -100, torch.zeros_like(ce), ce)


def _ignores_nothing(rs, w, tg):
    return per_loop_cross_entropy(rs, w, tg.clamp(min=0))


@pytest.mark.parametrize("fn", [_last_loop_grad_only, _head_grad_from_last_loop, _bf16_log_softmax, _ignores_nothing])
def test_readout_catches_broken_readouts(fn):
    c = nx.readout_check("cpu", readout_fn=fn, **READOUT)
    print(fn.__name__, c.detail)
    assert c.ok is False, c.detail


def test_fused_readout_matches_full_logits():
    c = nx.readout_check("cpu", fused=True, **READOUT)
    print(c.detail)
    assert c.ok and c.name == "readout fused", c.detail


def test_fused_readout_check_catches_a_broken_fused_path(monkeypatch):
    fused = nx.fused_per_loop_cross_entropy

    def head_detached(rs, w, tg, lw, *args):  # the LM head gets no gradient
        return fused(rs, w.detach(), tg, lw, *args)

    def last_loop_only(rs, w, tg, lw, *args):  # the earlier loops' readouts get no gradient
        rs = list(rs)
        return fused([r.detach() for r in rs[:-1]] + rs[-1:], w, tg, lw, *args)

    for broken in (head_detached, last_loop_only):
        monkeypatch.setattr(nx, "fused_per_loop_cross_entropy", broken)
        c = nx.readout_check("cpu", fused=True, **READOUT)
        assert c.ok is False, (broken.__name__, c.detail)


COMPILE = dict(
    dtype=torch.float32, backend="eager", preset_name="debug-tiny", seq_len=64, loops=(2, 3), doc_counts=(1, 3)
)


def test_compile_check_counts_breaks_and_recompiles(monkeypatch):
    """Plain attention compiles whole; a layer whose attention is `torch.compiler.disable`d (what the document-masked
    kernels are today) breaks the graph; one that guards on a changing Python value recompiles."""
    plain = nx.compile_check("cpu", doc_masking=False, **COMPILE)
    print(plain.detail)
    assert plain.ok and plain.numbers["graph_breaks"] == 0

    inner = looplm.attention
    monkeypatch.setattr(looplm, "attention", torch.compiler.disable(inner))
    broken = nx.compile_check("cpu", doc_masking=False, **COMPILE)
    assert broken.ok is False and broken.numbers["graph_breaks"] > 0, broken.detail

    calls = [0]

    def counting(q, k, v, mask, *args):  # a Python int that changes every call reaches the graph
        calls[0] += 1
        return inner(q, k, v, mask, *args) * (1.0 + 0.0 * calls[0])

    monkeypatch.setattr(looplm, "attention", counting)
    recompiling = nx.compile_check("cpu", doc_masking=False, **COMPILE)
    print(recompiling.detail)
    assert recompiling.ok is False and recompiling.numbers["graphs_last"] > recompiling.numbers["graphs_first"]


def _record(tmp_path, dtype: str, compile_: bool, steps: int = 3) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path / "k.json"
    args = runs.train_args(tmp_path / "run", "debug-tiny", {}, 4, 64, 1, steps=steps) + [
        *("--parallelism.compile", "true" if compile_ else "false", "--training.dtype", dtype),
        *("--data.motif_vocab", "0"),  # debug-tiny's vocabulary is the task's
    ]
    cmd = torchrun(1, "-m", "titanloop.checks", "--record-kernels", str(out), "--config", str(runs.TRAIN_CONFIG), *args)
    return subprocess.run(cmd, cwd=ROOT, env=environment(), capture_output=True, text=True, timeout=900), out


@pytest.mark.slow
def test_kernel_recorder_in_a_compiled_training_run(tmp_path):
    """What the checks run on CUDA, on CPU: a compiled `torchrun -m titanloop.train` run (fullgraph layers, per-loop
    AC, document masking) under the recorder, 3 steps at T = 4 with 2 layers: 24 layer calls per step. The recorder
    notes each forward's kernel where the mask is built, outside the compiled layers, so nothing in a graph guards
    on it. (At c79621e it appended to a list inside every compiled attention call: Dynamo guarded on the list's
    length, recompiled at every call and raised FailOnRecompileLimitHit at the 9th, which this run would hit.)"""
    proc, out = _record(tmp_path, "bfloat16", compile_=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = json.loads(out.read_text())
    assert len(records) == 3  # one forward per step (1 micro-batch)
    kernels = {tuple(r) for r in records}
    print("recorded:", kernels)
    # FSDP2's mixed precision hands attention bf16 (on CPU, at this size, the dense-mask kernel is the fastest)
    assert {(d, device) for _, d, device in records} == {("torch.bfloat16", "cpu")} and len(kernels) == 1
    c = nx.kernel_choice_check(records)
    assert c.ok is False and "not fused bf16 CUDA" in c.detail  # a CPU kernel


@pytest.mark.slow
def test_kernel_recorder_sees_the_master_dtype_leak(tmp_path):
    """With fp32 parameters the recorder sees fp32: what a master dtype leaking into attention looks like."""
    proc, out = _record(tmp_path, "float32", compile_=False, steps=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {(d, device) for _, d, device in json.loads(out.read_text())} == {("torch.float32", "cpu")}


def test_recorder_runs_under_a_compiled_forward():
    """The recorder itself inside a fullgraph-compiled LoopLM forward (as when the whole loop body compiles):
    torch.compiler.disable keeps it out of the graph, so 12 forwards record 12 entries and never recompile past the
    limit (a plain list.append in the graph would guard on the list and recompile every call)."""
    records: list = []
    original = looplm.LoopLM.rope_and_mask
    try:
        nx.record_kernels(records)
        torch.manual_seed(0)
        model = looplm.LoopLM(preset("debug-tiny", vocab_size=64, n_layers=1))
        compiled = torch.compile(model, backend="eager")
        x = torch.randint(0, 64, (1, 16))
        for _ in range(12):
            compiled(x, 2)
    finally:
        looplm.LoopLM.rope_and_mask = original
    assert len(records) == 12 and {tuple(r) for r in records} == {("sdpa_causal", "torch.float32", "cpu")}
