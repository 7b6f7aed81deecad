"""Depth far past the trained depth, and the two papers' model options, through the real entry points:

- `block_norm = "pre"`: a pre-norm layer h + f(norm(h)) with no norm on the branch outputs (the sandwich layer
  is not that function), its parameter count, the Ouro exporter's refusal and the variant round trip;
- one `torchrun -m titanloop.train` run on 2 CPU ranks at tp = 2 with a pre-norm block, no inter-loop norm, the
  per-loop CE averaged over loops (`objective.dense_reduction = "mean"`) and validation at T = 1, 4, 64; the
  validation at T = 64 equals `python -m titanloop.eval sweep` on the checkpoint, and
  `python -m titanloop.eval compare` draws both curves with the trained depth;
- the eval's default sweep (log-spaced to 64) scores T = 48 as a fresh 48-loop forward does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from launch import REPO, train
from titanloop.config_errors import ConfigError
from titanloop.eval import EvalConfig, depth_sweep
from titanloop.eval.compare import depth_curves
from titanloop.eval.sweep import DEPTH_LOOPS
from titanloop.interchange import export_ouro_hf
from titanloop.model import LoopLM, preset


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "titanloop.eval", *args],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_pre_norm_layer_is_h_plus_f_of_norm_h():
    torch.manual_seed(0)
    pre = LoopLM(preset("debug-tiny", block_norm="pre")).eval()
    layer = pre.layers[0]
    # scale the norms' gains so that a norm left on a branch output would show
    with torch.no_grad():
        for p in layer.parameters():
            if p.dim() == 1:
                p.mul_(1.7)
    h = torch.randn(2, 8, 64) * 3.0
    cos, sin, _ = pre.rope_and_mask(torch.zeros(2, 8, dtype=torch.long))
    a = h + layer.self_attn(layer.input_layernorm(h), cos, sin)
    expected = a + layer.mlp(layer.post_attention_layernorm(a))
    torch.testing.assert_close(layer(h, cos, sin), expected, rtol=0, atol=0)
    assert not hasattr(layer, "input_layernorm_2") and not hasattr(layer, "post_attention_layernorm_2")
    assert pre.num_params() == pre.cfg.param_count()

    sandwich = LoopLM(preset("debug-tiny")).eval()  # the default: every branch output normed
    s = sandwich.layers[0]
    a = h + s.self_attn(s.input_layernorm(h), cos, sin)
    assert (s(h, cos, sin) - (a + s.mlp(s.post_attention_layernorm(a)))).abs().max() > 0.1
    assert sandwich.num_params() == sandwich.cfg.param_count() == pre.num_params() + 2 * 2 * 64


def test_pre_norm_export_is_refused_as_ouro_and_round_trips_as_a_variant(tmp_path):
    from titanloop.interchange import import_ouro_hf

    torch.manual_seed(0)
    model = LoopLM(preset("debug-tiny", vocab_size=64, block_norm="pre")).eval()
    with pytest.raises(ConfigError, match="block_norm='pre'"):
        export_ouro_hf(model, tmp_path / "ouro")
    export_ouro_hf(model, tmp_path / "variant", allow_variant=True)
    back = import_ouro_hf(tmp_path / "variant")
    assert back.cfg.block_norm == "pre"
    ids = torch.randint(0, 64, (2, 12))
    torch.testing.assert_close(back(ids, 6).states[-1], model(ids, 6).states[-1], rtol=0, atol=0)


def test_block_norm_is_checked():
    with pytest.raises(ConfigError, match="block_norm='post' is invalid"):
        preset("debug-tiny", block_norm="post")


def test_default_sweep_reaches_64_and_scores_each_depth_as_a_fresh_forward():
    torch.manual_seed(0)
    model = LoopLM(preset("debug-tiny", vocab_size=64, n_loops=2, inter_loop_norm=False, block_norm="pre")).eval()
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 64, (12,), generator=g).tolist() for _ in range(3)]
    sweep = depth_sweep(model, seqs, cfg=EvalConfig(batch_size=3))
    assert sweep["loops"] == list(DEPTH_LOOPS) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]
    points = {p["loops"]: p["loss"] for p in sweep["points"]}
    ids = torch.tensor(seqs)
    with torch.no_grad():
        for t in (3, 48):  # each from scratch: a model that runs t loops and decodes the last
            logits = model(ids, t, return_logits="last").logits
            ce = F.cross_entropy(logits[:, :-1].reshape(-1, 64).float(), ids[:, 1:].reshape(-1))
            assert points[t] == pytest.approx(float(ce), rel=1e-5, abs=1e-6)
    assert points[48] != pytest.approx(points[3], rel=1e-3)  # the depths differ (the check can tell them apart)


@pytest.fixture(scope="module")
def deep_run(tmp_path_factory):
    """A pre-norm, averaged per-loop CE run at tp = 2, validated at T = 1, 4 and 64, and its checkpoint."""
    tmp = tmp_path_factory.mktemp("deep")
    steps = 3
    overrides = {
        "model.block_norm": "pre",
        "model.inter_loop_norm": False,
        "objective.name": "dense",
        "objective.dense_alpha": 3.0,
        "objective.dense_reduction": "mean",
        "training.steps": steps,
        "training.seq_len": 32,
        "training.micro_batch_size": 4,
        "training.global_batch_size": 8,
        "parallelism.tp": 2,
        "metrics.log_freq": 1,
        "checkpoint.enable": True,
        "checkpoint.interval": steps,
        "checkpoint.mode": "sync",
        "validation.enable": True,
        "validation.freq": steps,
        "validation.steps": 2,
        "validation.batch_size": 4,
        "validation.loops": [1, 4, 64],
    }
    run = tmp / "run"
    done = train(run, overrides, nproc=2)
    return tmp, run, done, steps


def test_per_loop_ce_averaged_over_loops(deep_run):
    _, _, done, _ = deep_run
    first = done.by_step[1]
    ce = first["ce"]
    assert len(ce) == 4
    assert first["loss"] == pytest.approx(sum(ce) / 4, rel=1e-5)  # "sum" would give sum(ce), 4x this


def test_validation_at_64_loops_equals_the_eval_cli_and_compare_draws_both(deep_run):
    tmp, run, done, steps = deep_run
    val = [r for r in done.rows if "val/loss/loop_64" in r][-1]
    spec = tmp / "data.json"
    spec.write_text(json.dumps({"kind": "synthetic_text", "seed": 1}))
    r = _cli(
        "sweep", str(run / "checkpoints" / f"step-{steps:08d}"), "--data", str(spec), "--out", str(tmp / "eval"),
        "--device", "cpu", "--dtype", "float32", "--batch-size", "4", "--max-batches", "2", "--seq-len", "32",
        "--loops", "1,4,64", "--no-diagnostics",
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads((tmp / "eval" / "report.json").read_text())
    swept = {p["loops"]: p["loss"] for p in report["depth_sweep"]["points"]}
    for t in (1, 4, 64):
        assert val[f"val/loss/loop_{t}"] == pytest.approx(swept[t], rel=1e-5)
    # the exit frontier reaches the deepest swept T by default
    assert max(p["avg_loops"] for p in report["exit_frontier"]["points"]) == pytest.approx(64.0)

    r = _cli("compare", str(tmp / "eval"), str(run), "--labels", "sweep,validation", "--out", str(tmp / "cmp"))
    assert r.returncode == 0, r.stderr
    assert "64" in r.stdout and "*" in r.stdout
    got = json.loads((tmp / "cmp" / "depth_comparison.json").read_text())
    by_label = {c["label"]: c for c in got["curves"]}
    assert by_label["sweep"]["loss"] == [swept[t] for t in (1, 4, 64)]
    assert by_label["validation"]["loss"] == [val[f"val/loss/loop_{t}"] for t in (1, 4, 64)]
    assert by_label["sweep"]["trained_loops"] == by_label["validation"]["trained_loops"] == 4
    png = (tmp / "cmp" / "depth_comparison.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_compare_bad_input_is_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    r = _cli("compare", str(tmp_path / "empty"), "--out", str(tmp_path / "cmp"))
    assert r.returncode != 0
    assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1 and "is not a depth curve" in r.stderr
    assert not (tmp_path / "cmp").exists()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    with pytest.raises(ConfigError, match="--labels has 2 name"):
        depth_curves([tmp_path / "run"], ["a", "b"])
    r = _cli("compare", str(tmp_path / "run"), "--out", str(tmp_path / "cmp"))
    assert r.returncode != 0 and "has no validation" in r.stderr and r.stderr.count("\n") == 1
