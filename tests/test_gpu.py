"""GPU-only correctness checks that need no orchestration (marker `gpu`: `pytest -m gpu tests/test_gpu.py` on a
CUDA machine). Without CUDA each is skipped with a reason that starts "needs a CUDA GPU", which tests/conftest.py
allows under CI=true (tests/test_conftest_ci_skips.py runs this file that way). The tests without the marker hold
the rules these checks use against the bugs they exist for, on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from titanloop.checks import numerics as nm
from titanloop.eval.generate import GenerationConfig, generate
from titanloop.model import LoopLM, preset

ROOT = Path(__file__).resolve().parents[1]
GPU = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: torch.cuda.is_available() is False"),
]


def gpu(fn):
    for mark in GPU:
        fn = mark(fn)
    return fn


# ----- the numerics of the fast path (titanloop.checks.numerics), on GPU 0 -------------------------------------
NUMERICS = {
    "attention docs": lambda: nm.attention_check("attention docs", "cuda", nm.doc_ids_with(3, 2, 1024)),
    "attention plain": lambda: nm.attention_check("attention plain", "cuda"),
    "bf16 logits": lambda: nm.bf16_logits_check("cuda"),
    "compile": lambda: nm.compile_check("cuda"),
    "readout": lambda: nm.readout_check("cuda"),
    "readout fused": lambda: nm.readout_check("cuda", fused=True),
}


@gpu
@pytest.mark.parametrize("name", NUMERICS)
def test_numerics_on_cuda(name):
    check = NUMERICS[name]()
    assert check.ok, check.detail


# ----- generation with the KV cache equals recomputation ---------------------------------------------------------
@torch.no_grad()
def cache_vs_recompute(model: LoopLM, prompt: torch.Tensor, n_new: int, n_loops: int, reference=None) -> list[str]:
    """Greedy tokens with the KV cache vs without (a full forward per token); the divergences that are not at a near
    tie of the no-cache logits (an empty list: the cache is right). A near tie: a top-2 gap of at most max(4 units
    in the last place of the largest logit, 4 e), e = max |logits - reference logits| at that prefix with
    `reference` the float32 copy of a lower-precision model: each path's gap is off by up to 2 e. In float32 only
    the units-in-the-last-place bound applies, which a cache bug (a wrong position, a stale K/V) breaks."""
    cached = generate(model, prompt, GenerationConfig(max_new_tokens=n_new, n_loops=n_loops)).new_tokens.cpu()
    fresh = generate(model, prompt, GenerationConfig(max_new_tokens=n_new, n_loops=n_loops, use_cache=False))
    fresh, dtype, bad = fresh.new_tokens.cpu(), model.embed_tokens.weight.dtype, []
    for b in range(prompt.shape[0]):
        diff = (cached[b] != fresh[b]).nonzero()
        if not diff.numel():
            continue
        prefix = torch.cat([prompt[b].cpu(), fresh[b, : int(diff[0])]])[None].to(prompt.device)
        logits = model(prefix, n_loops, return_logits="last").logits[0, -1].float()
        gap = float(logits.topk(2).values.diff().abs())
        tol = 4 * torch.finfo(dtype).eps * float(logits.abs().max())
        if reference is not None and dtype != torch.float32:
            e = float((logits - reference(prefix, n_loops, return_logits="last").logits[0, -1].float()).abs().max())
            tol = max(tol, 4 * e)
        if gap > tol:
            bad.append(f"row {b} at token {int(diff[0])}: top-2 gap {gap:.3g} > near-tie bound {tol:.3g}")
    return bad


def test_the_cache_rule_catches_a_position_bug(monkeypatch):
    """On the CPU: the real cache passes the float32 rule; a decode one position off (a RoPE offset bug) fails it."""
    from titanloop.eval import generate as gen_mod

    torch.manual_seed(0)
    model = LoopLM(preset("debug-tiny")).eval()
    prompt = torch.randint(0, model.cfg.vocab_size, (4, 8), generator=torch.Generator().manual_seed(1))
    assert all(cache_vs_recompute(model, prompt, 12, t) == [] for t in (1, 4))
    real = gen_mod._run_loops

    def off_by_one(model_, ids, n_loops, cfg, **kw):
        if "position_offset" in kw:
            kw["position_offset"] += 1
        return real(model_, ids, n_loops, cfg, **kw)

    monkeypatch.setattr(gen_mod, "_run_loops", off_by_one)
    assert any(cache_vs_recompute(model, prompt, 12, t) for t in (1, 4))


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_cache_generation_equals_recomputation_on_cuda(dtype):
    torch.manual_seed(0)
    reference = LoopLM(preset("debug-small")).cuda().eval()
    model = reference if dtype == torch.float32 else LoopLM(preset("debug-small")).cuda().to(dtype).eval()
    model.load_state_dict(reference.state_dict())
    prompt = torch.randint(0, model.cfg.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0)).cuda()
    for t in (1, 4, 8):
        assert cache_vs_recompute(model, prompt, 24, t, reference) == [], t


# ----- the LM-head statistics synchronize once per batch -------------------------------------------------------
def sync_warnings(caught: list) -> list:
    """The warnings that report a synchronizing CUDA call, not torch's one-time notice that the debug mode is a
    prototype feature (an earlier counter matched it and counted 2 syncs where there was 1)."""
    return [w for w in caught if "called a synchronizing CUDA operation" in str(w.message)]


def test_the_sync_count_leaves_out_torchs_notice():
    def w(msg: str) -> warnings.WarningMessage:
        return warnings.WarningMessage(UserWarning(msg), UserWarning, "x.py", 1)

    caught = [
        w("Synchronization debug mode is a prototype feature and does not yet detect all synchronizing ops"),
        w("called a synchronizing CUDA operation (Triggered internally at CUDAFunctions.cpp:176.)"),
        w("some other warning"),
    ]
    assert [str(x.message)[:8] for x in sync_warnings(caught)] == ["called a"]


def count_syncs(fn) -> int:
    fn()  # first-call work (a lazily created handle) is not a per-call sync
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return len(sync_warnings(caught))


@gpu
def test_head_statistics_sync_once_and_not_per_loop_or_chunk():
    from titanloop.eval.stats import _head_stats, batch_stats

    torch.manual_seed(0)
    model = LoopLM(preset("debug-small")).cuda().to(torch.bfloat16).eval()
    v, h = model.cfg.vocab_size, model.cfg.hidden_size
    readouts, targets = torch.randn(8, 4096, h, device="cuda", dtype=torch.bfloat16), torch.randint(0, v, (4096,))
    with torch.no_grad():
        assert count_syncs(lambda: _head_stats(readouts, model.lm_head.weight, targets.cuda(), 1024).cpu()) <= 1
        ids = torch.randint(0, v, (2, 513))
        batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:], "token_mask": torch.ones(2, 512, dtype=torch.bool)}
        few = count_syncs(lambda: batch_stats(model, batch, 2, chunk_size=4096))
        many = count_syncs(lambda: batch_stats(model, batch, 8, chunk_size=128))
    assert few == many, (few, many)


# ----- loading straight onto the GPU, and the eval CLI's default device ----------------------------------------
PEAK_LOAD = r"""
import json, sys, threading, time
import torch
from titanloop.checkpoint.loading import load_model
torch.zeros(1, device="cuda")  # the CUDA context first: its host memory is not the checkpoint's
def rss():
    return int(next(l for l in open("/proc/self/status") if l.startswith("RssAnon:")).split()[1]) * 1024
peak, done, base = 0, threading.Event(), rss()
def watch():
    global peak
    while not done.is_set():
        peak = max(peak, rss()); time.sleep(0.0005)
t = threading.Thread(target=watch, daemon=True); t.start()
model = load_model(sys.argv[1], device="cuda", dtype=torch.bfloat16); torch.cuda.synchronize(); done.set(); t.join()
params = {id(p): p for p in model.parameters()}.values()
print(json.dumps({"extra": max(peak, rss()) - base, "checksum": sum(float(p.double().sum()) for p in params)}))
"""


@gpu
@pytest.mark.slow
def test_loading_onto_the_gpu_holds_a_fraction_of_the_checkpoint_on_the_host(tmp_path):
    """An ouro-1.4b-shaped checkpoint (HF export, random weights) loaded with load_model onto the GPU: the host's
    peak extra memory stays below 0.25x the checkpoint (one stored tensor at a time; the old loader held 1x)."""
    from titanloop.interchange import export_ouro_hf

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LoopLM(preset("ouro-1.4b")).to(torch.bfloat16)
    params = {id(p): p for p in model.parameters()}.values()
    nbytes, checksum = sum(p.numel() * p.element_size() for p in params), sum(float(p.double().sum()) for p in params)
    path = export_ouro_hf(model, tmp_path / "hf")
    del model
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", PEAK_LOAD, str(path)], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["extra"] < 0.25 * nbytes and got["checksum"] == pytest.approx(checksum, rel=1e-6), (got, nbytes)


@gpu
def test_the_eval_cli_generates_on_cuda_in_bf16_by_default(tmp_path):
    from titanloop.checkpoint.loading import load_model
    from titanloop.interchange import export_ouro_hf

    torch.manual_seed(0)
    path = export_ouro_hf(LoopLM(preset("debug-small")).eval(), tmp_path / "hf")
    cmd = [sys.executable, "-m", "titanloop.eval", "generate", str(path), "--prompt-ids", "3,14,15,9,26"]
    proc = subprocess.run([*cmd, "--max-new-tokens", "12"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    model = load_model(path, device="auto", dtype="auto")
    want = generate(model, torch.tensor([[3, 14, 15, 9, 26]]), GenerationConfig(max_new_tokens=12)).new_tokens[0]
    assert (out["device"].split(":")[0], out["dtype"]) == ("cuda", "bfloat16") and out["new_tokens"] == want.tolist()
