"""titanloop.eval on a chosen device (issue 36): loading straight onto the device, per-token statistics without
per-chunk host copies, `--device` / `--dtype` in `python -m titanloop.eval`.

- load_model(path, device, dtype) allocates the model once, on the device, in the dtype, and reads the stored
  tensors into it: tied embeddings stay tied, values are those of the old load-then-cast, and while a checkpoint
  loads the process never holds a second full copy of it in CPU memory (peak anonymous RSS, measured);
- the statistics are bitwise those of the version that copied every chunk into CPU tensors (its code is kept
  below as the reference), and one batch runs on the meta device, which refuses any copy to the host;
- the CLI: defaults and what runs where in --help, one-line usage errors (exit status 2) for bad values, and
  on a machine without CUDA the default run gives exactly the old numbers.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from titanloop.checkpoint import CheckpointConfig, Checkpointer
from titanloop.config_errors import ConfigError
from titanloop.eval import EvalConfig, eval_batches, evaluate, load_model
from titanloop.eval.generate import GenerationConfig, generate
from titanloop.eval.stats import LoopStats, _head_stats, batch_stats, collect_loop_stats
from titanloop.eval.trace import iter_loops
from titanloop.interchange import export_ouro_hf
from titanloop.model import LoopLM, preset
from titanloop.objectives import IGNORE_INDEX


REPO = Path(__file__).resolve().parents[1]
STAT_FIELDS = ("ce", "correct", "margin", "ash_delta", "hidden_delta", "gate_logits", "row", "state_rms")


# ----- the statistics as computed before (every chunk copied into CPU tensors): the reference ------------------
def old_head_stats(readouts, weight, targets, chunk_size):
    """The eval's LM-head statistics as they were: every (chunk, loop) result copied into CPU tensors."""
    t_total, n, _ = readouts.shape
    ce, margin = torch.empty(t_total, n), torch.empty(t_total, n)
    correct, ash = torch.empty(t_total, n, dtype=torch.bool), torch.full((t_total, n), math.inf)
    for s in range(0, n, chunk_size):
        e = min(n, s + chunk_size)
        prev = None
        for t in range(t_total):
            logits = (readouts[t, s:e] @ weight.t()).float()
            logp = torch.log_softmax(logits, dim=-1)
            p = logp.exp()
            ce[t, s:e] = -logp.gather(1, targets[s:e, None])[:, 0]
            correct[t, s:e] = logits.argmax(-1) == targets[s:e]
            top = p.topk(min(2, p.shape[-1]), dim=-1).values
            margin[t, s:e] = top[:, 0] - (top[:, 1] if top.shape[1] > 1 else 0.0)
            if prev is not None:
                ash[t, s:e] = (p - prev).abs().sum(-1)
            prev = p
    return ce, correct, margin, ash


@torch.no_grad()
def old_collect_loop_stats(model, batches, n_loops, *, chunk_size=1024, progress=None):
    device = model.embed_tokens.weight.device
    weight = model.lm_head.weight
    parts = {k: [] for k in ("ce", "correct", "margin", "ash", "hdelta", "gate", "row", "rms")}
    row_offset = 0
    for batch in batches:
        ids, labels = batch["input_ids"].to(device), batch["labels"].to(device)
        scored = labels != IGNORE_INDEX
        real = batch["token_mask"].to(device)
        readouts, gates, hdelta, rms = [], [], [], []
        prev = None
        for step in iter_loops(model, ids, n_loops, doc_ids=batch.get("doc_ids")):
            readouts.append(step.exit_readout[scored])
            gates.append(step.gate_logit[scored].float())
            x = step.normed[scored].float()
            hdelta.append(
                torch.full((x.shape[0],), math.inf) if prev is None else (x - prev).pow(2).mean(-1).sqrt().cpu()
            )
            prev = x
            rms.append(step.state[real].float().pow(2).mean(-1).sqrt().cpu())
        ce, correct, margin, ash = old_head_stats(torch.stack(readouts), weight, labels[scored], chunk_size)
        parts["ce"].append(ce)
        parts["correct"].append(correct)
        parts["margin"].append(margin)
        parts["ash"].append(ash)
        parts["hdelta"].append(torch.stack(hdelta))
        parts["gate"].append(torch.stack(gates).cpu())
        parts["rms"].append(torch.stack(rms))
        key = torch.arange(ids.shape[0], device=device)[:, None] * (ids.shape[1] + 1) + row_offset
        if batch.get("doc_ids") is not None:
            key = key + batch["doc_ids"].to(device)
        parts["row"].append(key.expand_as(ids)[scored].cpu())
        row_offset += ids.shape[0] * (ids.shape[1] + 1)
    row = torch.unique(torch.cat(parts["row"]), return_inverse=True)[1]
    return LoopStats(
        ce=torch.cat(parts["ce"], 1),
        correct=torch.cat(parts["correct"], 1),
        margin=torch.cat(parts["margin"], 1),
        ash_delta=torch.cat(parts["ash"], 1),
        hidden_delta=torch.cat(parts["hdelta"], 1),
        gate_logits=torch.cat(parts["gate"], 1),
        row=row,
        n_rows=int(row.max()) + 1 if row.numel() else 0,
        state_rms=torch.cat(parts["rms"], 1),
    )


def ragged_batches(vocab=64, n=11, seed=0) -> list[dict]:
    """Rows of different lengths (padding, so token_mask matters), and one packed batch with documents."""
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, vocab, (int(torch.randint(4, 40, (1,), generator=g)),), generator=g) for _ in range(n)]
    batches = eval_batches(seqs, batch_size=4)
    ids = batches[0]["input_ids"]
    batches[0]["doc_ids"] = (torch.arange(ids.shape[1]) // 9).expand_as(ids).contiguous()
    return batches


@pytest.mark.parametrize("chunk_size", [1, 7, 1024])
@pytest.mark.parametrize("overrides", [{}, {"readout": "final_only_norm", "n_coda_layers": 1}])
def test_stats_are_bitwise_the_per_chunk_copy_version(chunk_size, overrides):
    torch.manual_seed(0)
    model = LoopLM(preset("debug-tiny", vocab_size=64, n_layers=2, **overrides)).eval()
    with torch.no_grad():
        model.early_exit_gate.weight.normal_(0, 1.0)
    batches = ragged_batches()
    new = collect_loop_stats(model, batches, 5, chunk_size=chunk_size)
    old = old_collect_loop_stats(model, batches, 5, chunk_size=chunk_size)
    assert new.n_rows == old.n_rows and new.n_tokens == old.n_tokens > 0
    for name in STAT_FIELDS:
        a, b = getattr(new, name), getattr(old, name)
        assert a.device.type == "cpu" and a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), f"{name} differs from the per-chunk-copy version"


def test_one_batch_runs_on_the_device_without_host_copies():
    """A model on the meta device: any .cpu(), .item(), float(...), bool(...) or copy into a CPU tensor of a meta
    tensor raises, so this runs only if the statistics stay on the device until the caller's one copy per batch.
    (The version that wrote every chunk into CPU tensors raises here: 'Cannot copy out of meta tensor'.)"""
    with torch.device("meta"):
        model = LoopLM(preset("debug-tiny", vocab_size=64, n_layers=2))
    batch = ragged_batches()[0]
    n_scored = int((batch["labels"] != IGNORE_INDEX).sum())
    per_token, rms = batch_stats(model, batch, 4, chunk_size=5)
    assert per_token.device.type == "meta" and per_token.shape == (6, 4, n_scored)
    assert rms.device.type == "meta" and rms.shape == (4, int(batch["token_mask"].sum()))
    args = (
        torch.empty(3, 40, 16, device="meta"),
        torch.empty(64, 16, device="meta"),
        torch.zeros(40, dtype=torch.long, device="meta"),
        7,
    )
    head = _head_stats(*args)
    assert head.device.type == "meta" and head.shape == (4, 3, 40)
    with pytest.raises(NotImplementedError, match="meta"):  # the reference version copies every chunk to the host
        old_head_stats(*args)


# ----- loading straight onto the device -------------------------------------------------------------------------
def save_dcp(model: LoopLM, section: dict, run_dir: Path) -> Path:
    ck = Checkpointer(CheckpointConfig(mode="sync"), run_dir, {"model": model}, config={"model": section})
    ck.save(1, sync=True)
    ck.close()
    return run_dir / "checkpoints"


@pytest.mark.parametrize("fmt", ["dcp", "hf"])
@pytest.mark.parametrize("tied", [False, True])
def test_load_onto_a_device_in_a_dtype(tmp_path, fmt, tied):
    """The model comes out in the asked dtype, with the values of the old load-in-float32-then-cast, and a tied
    LM head is still the embedding (one tensor: the meta build + to_empty unties them unless re-tied)."""
    section = {"preset": "debug-tiny", "vocab_size": 64, "n_layers": 1, "tie_embeddings": tied}
    torch.manual_seed(0)
    model = LoopLM(preset(section["preset"], **{k: v for k, v in section.items() if k != "preset"})).eval()
    path = save_dcp(model, section, tmp_path / "run") if fmt == "dcp" else export_ouro_hf(model, tmp_path / "hf")
    ids = torch.randint(0, 64, (2, 9))
    for dtype in (torch.float32, torch.bfloat16):
        loaded = load_model(path, device="cpu", dtype=dtype)
        old_way = LoopLM(model.cfg).eval()
        old_way.load_state_dict(model.state_dict())
        old_way.to(dtype)
        assert {p.dtype for p in loaded.parameters()} == {dtype}
        assert (loaded.lm_head.weight is loaded.embed_tokens.weight) == tied
        assert len(list(loaded.parameters())) == len(list(model.parameters()))
        for (name, a), b in zip(loaded.state_dict().items(), old_way.state_dict().values()):
            assert torch.equal(a, b), name
        with torch.no_grad():
            out = loaded(ids, return_logits="last").logits
            ref = old_way(ids, return_logits="last").logits
        assert torch.equal(out, ref)
        if tied:  # really one tensor: a change to the embedding is a change to the head
            with torch.no_grad():
                loaded.embed_tokens.weight[0, 0] += 1.0
            assert loaded.lm_head.weight[0, 0] == loaded.embed_tokens.weight[0, 0]


PEAK_SCRIPT = r"""
import json, sys, threading, time
import torch
from titanloop.eval import load_model

def rss_anon():  # anonymous resident memory: what the process allocated (not the page cache of mmapped files)
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024

peak, done = 0, threading.Event()

def watch():
    global peak
    while not done.is_set():
        peak = max(peak, rss_anon())
        time.sleep(0.0005)

base = rss_anon()
thread = threading.Thread(target=watch, daemon=True)
thread.start()
try:
    model = load_model(sys.argv[1], device=torch.device(sys.argv[2]), dtype=torch.float32)
finally:
    done.set()
    thread.join()
peak = max(peak, rss_anon())
print(json.dumps({"extra": peak - base, "devices": sorted({p.device.type for p in model.parameters()})}))
"""


def test_loading_never_holds_a_second_copy_on_the_cpu(tmp_path):
    """Load a 126 MB float32 checkpoint (30 layers, largest tensor 1 MB) in a fresh process and sample its
    anonymous RSS (allocated memory; the page cache of an mmapped safetensors file is not counted).

    - safetensors onto the meta device (standing in for a GPU: the tensors leave the CPU): loading tensor by
      tensor keeps the peak far below the checkpoint (< 0.25x); the old import held the whole state on the CPU
      before moving it (1x).
    - DCP onto the CPU (DCP itself materializes meta targets on the process group's device, so the CPU is the
      target here): the model is the one copy (1x, < 1.25x allowed); the old loader random-initialized the model
      and read into a second full set of tensors (2x).
    """
    section = {
        "preset": "debug-tiny",
        "vocab_size": 1024,
        "hidden_size": 256,
        "n_heads": 4,
        "ffn_hidden_size": 1024,
        "n_layers": 30,
    }
    torch.manual_seed(0)
    model = LoopLM(preset(section["preset"], **{k: v for k, v in section.items() if k != "preset"}))
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert nbytes > 120e6 and max(p.numel() * 4 for p in model.parameters()) <= 1.1e6
    cases = {
        "hf": (export_ouro_hf(model, tmp_path / "hf"), "meta", 0.25),
        "dcp": (save_dcp(model, section, tmp_path / "run"), "cpu", 1.25),
    }
    del model
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    for fmt, (path, device, limit) in cases.items():
        proc = subprocess.run(
            [sys.executable, "-c", PEAK_SCRIPT, str(path), device],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        ratio = out["extra"] / nbytes
        print(f"{fmt} -> {device}: peak extra anonymous RSS {ratio:.2f}x the {nbytes / 1e6:.0f} MB checkpoint")
        assert out["devices"] == [device]
        assert ratio < limit, f"{fmt} -> {device}: peak {ratio:.2f}x the checkpoint held on the CPU (limit {limit}x)"


def test_load_model_names_bad_device_and_dtype(tmp_path):
    export_ouro_hf(LoopLM(preset("debug-tiny", vocab_size=64, n_layers=1)), tmp_path / "hf")
    with pytest.raises(ConfigError, match=r"^device='gpu' is invalid: expected auto, cpu, cuda or cuda:N$"):
        load_model(tmp_path / "hf", device="gpu")
    with pytest.raises(ConfigError, match=r"^dtype='half' is invalid: expected auto, float32, bfloat16 or float16$"):
        load_model(tmp_path / "hf", dtype="half")
    auto = load_model(tmp_path / "hf", device="auto", dtype="auto")
    expected = ("cuda", torch.bfloat16) if torch.cuda.is_available() else ("cpu", torch.float32)
    assert (auto.embed_tokens.weight.device.type, auto.embed_tokens.weight.dtype) == expected


# ----- the CLI ------------------------------------------------------------------------------------------------
def run_cli(*args):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg", "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "titanloop.eval", *args], capture_output=True, text=True, env=env, timeout=300
    )


def test_help_says_what_runs_where():
    for sub in ("sweep", "generate"):
        r = run_cli(sub, "--help")
        assert r.returncode == 0, r.stderr
        text = " ".join(r.stdout.split())
        assert "--device" in text and "--dtype" in text
        assert "auto (default: cuda when torch.cuda.is_available(), else cpu)" in text
        assert "auto (default: bfloat16 on cuda, float32 on cpu)" in text


# Runs `python -m titanloop.eval ARGS` as runpy does, then prints whether torch was imported and the exit status.
_TORCH_PROBE = """
import runpy, sys
sys.argv = ["python -m titanloop.eval", *sys.argv[1:]]
try:
    runpy.run_module("titanloop.eval", run_name="__main__", alter_sys=True)
    code = 0
except SystemExit as e:
    code = e.code
print("torch imported:", "torch" in sys.modules, "exit:", code, file=sys.stderr)
"""


@pytest.mark.parametrize(
    "args,code",
    [(["--help"], 0), (["sweep", "--help"], 0), (["generate", "--help"], 0), (["sweep", "ckpt"], 2), ([], 2)],
)
def test_help_and_argument_errors_answer_before_torch_loads(args, code):
    """`--help` and argparse's usage errors need no torch, so they answer at once (5 s sooner on this machine):
    neither the package's names (loaded on first use) nor the CLI import it before the arguments parse."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", _TORCH_PROBE, *args], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.stderr.strip().splitlines()[-1] == f"torch imported: False exit: {code}", proc.stderr[-2000:]


def test_every_name_of_the_package_loads_from_its_module():
    """titanloop.eval lists its names twice: `__all__`, and `_EXPORTS` (name -> module) for loading them on first
    use. They must agree, and each name must be the object its module defines (a name added to one list only would
    break `from titanloop.eval import *` or the lazy load)."""
    import importlib

    import titanloop.eval as package

    assert sorted(package.__all__) == sorted(package._EXPORTS)
    for name, module in package._EXPORTS.items():
        assert getattr(package, name) is getattr(importlib.import_module(module), name), name


@pytest.mark.parametrize(
    "flag,value,expected",
    [
        ("--device", "tpu", "expected auto, cpu, cuda or cuda:N"),
        ("--device", "cuda:x", "expected auto, cpu, cuda or cuda:N"),
        ("--dtype", "int8", "expected auto, float32, bfloat16 or float16"),
    ],
)
def test_bad_device_or_dtype_is_a_one_line_usage_error(tmp_path, flag, value, expected):
    for args in (
        ["sweep", str(tmp_path / "ckpt"), "--data", "task:mano", "--out", str(tmp_path / "out")],
        ["generate", str(tmp_path / "ckpt"), "--prompt-ids", "1,2"],
    ):
        r = run_cli(*args, flag, value)
        assert r.returncode == 2, (r.returncode, r.stderr)
        assert r.stderr == f"error: {flag}={value!r} is invalid: {expected}\n"
        assert r.stdout == ""
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA (the test is for machines without)")
def test_cuda_without_a_gpu_is_a_one_line_usage_error(tmp_path):
    r = run_cli("generate", str(tmp_path), "--prompt-ids", "1", "--device", "cuda")
    assert r.returncode == 2
    assert r.stderr == (
        "error: --device='cuda' is invalid here: torch.cuda.is_available() is False on this machine; "
        "expected auto or cpu\n"
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA (the default there is cuda, bfloat16)")
def test_default_cli_run_on_a_cpu_machine_gives_the_old_numbers(tmp_path, monkeypatch):
    """Without CUDA, `sweep` and `generate` with no --device/--dtype run on the CPU in float32 and give exactly
    the numbers of the in-memory model evaluated with the pre-issue-36 statistics (JSON floats round-trip)."""
    torch.manual_seed(0)
    model = LoopLM(preset("debug-tiny", vocab_size=64, n_layers=2, n_loops=2)).eval()
    with torch.no_grad():
        model.early_exit_gate.weight.normal_(0, 1.0)
    export_ouro_hf(model, tmp_path / "hf")
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(6, 30, (9,), generator=g).tolist()
    seqs = [torch.randint(0, 64, (n,), generator=g).tolist() for n in lengths]
    data = tmp_path / "seqs.jsonl"
    data.write_text("\n".join(json.dumps(s) for s in seqs))
    r = run_cli(
        "sweep", str(tmp_path / "hf"), "--data", str(data), "--out", str(tmp_path / "ev"), "--batch-size", "4",
        "--chunk-size", "16", "--jsrr-loops", "1,2", "--q", "0,0.5,0.9,1", "--loops", "1,2,3,4",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "on cpu in float32" in r.stdout
    cli = json.loads((tmp_path / "ev" / "report.json").read_text())
    assert cli["model"]["device"] == "cpu" and cli["model"]["dtype"] == "float32"

    monkeypatch.setattr("titanloop.eval.sweep.collect_loop_stats", old_collect_loop_stats)
    cfg = EvalConfig(
        batch_size=4, chunk_size=16, jsrr_loops=[1, 2], q_thresholds=[0.0, 0.5, 0.9, 1.0], loops=[1, 2, 3, 4]
    )
    old = json.loads(json.dumps(evaluate(model, seqs, cfg)))  # through JSON like report.json (inf -> Infinity)
    for key in ("data", "depth_sweep", "exit_frontier", "diagnostics"):
        assert cli[key] == old[key], key

    r = run_cli("generate", str(tmp_path / "hf"), "--prompt-ids", "5,17,3", "--max-new-tokens", "6")
    assert r.returncode == 0, r.stderr
    expected = generate(model, torch.tensor([[5, 17, 3]]), GenerationConfig(max_new_tokens=6)).new_tokens[0].tolist()
    out = json.loads(r.stdout)
    assert out["new_tokens"] == expected and (out["device"], out["dtype"]) == ("cpu", "float32")
