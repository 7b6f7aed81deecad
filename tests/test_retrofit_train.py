"""Ouroboros retrofit through the real trainer: `torchrun -m titanloop.train --config
train_configs/ouroboros_retrofit.toml` on 2 CPU ranks (gloo, FSDP2) from a tiny local Qwen2 checkpoint.

One uninterrupted run and one run SIGKILLed after a checkpoint and restarted (auto-resume) share the
assertions: only the controller / gate / step norms change, the optimizer holds state for those only, the
resumed run ends with the same losses and weights as the uninterrupted one, the counts are printed, and the
trained run exports and reloads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from titanloop.checkpoint import layout
from titanloop.retrofit import RetrofitConfig
from titanloop.retrofit.checkpoint import load_retrofit_checkpoint
from titanloop.retrofit.config import LOOP_KEYS
from titanloop.retrofit.hf_import import load_retrofit

from launch import SMALL_BATCH, Launch, metrics, start

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "train_configs" / "ouroboros_retrofit.toml"
STEPS = 10
RETROFIT = {"n_prelude": 2, "recurrent_layer": 3, "n_coda": 1, "lora_rank": 4, "style_dim": 8, "max_loops": 4}


def _launch(hf: Path, run_dir: Path) -> Launch:
    overrides = {
        "retrofit.hf_path": str(hf),
        "loop_sampler.n_loops": 2,
        "data.kind": "synthetic_text",
        **SMALL_BATCH,
        "training.steps": STEPS,
        "checkpoint.interval": 2,
        "checkpoint.keep_latest_k": 2,
        "lr_scheduler.warmup_steps": 2,
        "optimizer.lr": 0.01,
        "metrics.wandb": "off",
        "metrics.log_freq": 1,
        "metrics.count_comms": True,
        # the loop settings (max_loops) are [model] keys, the rest [retrofit]'s
        **{f"{'model' if k in LOOP_KEYS else 'retrofit'}.{k}": v for k, v in RETROFIT.items()},
    }
    return start(run_dir, overrides, config=CONFIG)


def _log(run_dir: Path) -> str:
    return "".join(p.read_text() for p in sorted(run_dir.glob("launch-*.log")))


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in metrics(run_dir)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tmp = tmp_path_factory.mktemp("retrofit_train")
    torch.manual_seed(0)
    Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=6,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
    ).save_pretrained(tmp / "dense")
    ref = _launch(tmp / "dense", tmp / "uninterrupted")
    killed_dir = tmp / "killed"
    killed = _launch(tmp / "dense", killed_dir)
    killed.wait_until(lambda: (layout.latest_step(killed_dir / "checkpoints") or 0) >= 2, "checkpoint 2", 400, 0.05)
    killed.kill()
    killed_at = layout.latest_step(killed_dir / "checkpoints")
    assert killed_at < STEPS, f"the run finished ({killed_at}) before the kill: nothing was tested"
    assert ref.finish(600) == 0, _log(tmp / "uninterrupted")[-3000:]
    resumed = _launch(tmp / "dense", killed_dir)
    assert resumed.finish(600) == 0, _log(killed_dir)[-3000:]
    return tmp, killed_at


def test_only_extras_train_and_are_counted(runs):
    tmp, _ = runs
    log = _log(tmp / "uninterrupted")
    base = load_retrofit(RetrofitConfig(hf_path=str(tmp / "dense"), **RETROFIT, n_loops=2))
    trainable, frozen = base.param_counts()
    assert f"{trainable:,} trainable parameters, {frozen:,} frozen" in log
    trained = load_retrofit_checkpoint(tmp / "uninterrupted" / "checkpoints")
    init, final = base.state_dict(), trained.state_dict()
    changed = {k for k in init if not torch.equal(init[k], final[k])}
    extras = {n for n, p in base.named_parameters() if p.requires_grad}
    assert changed and changed <= extras, changed - extras  # the frozen base (and LoRA bases) never moved
    assert any(k.startswith("modulation.heads") for k in changed)  # the zero-init controller heads did
    losses = _losses(tmp / "uninterrupted")
    assert sorted(losses) == list(range(1, STEPS + 1))


def test_optimizer_state_and_gradient_reduction_only_for_trainable(runs):
    from titanloop.checkpoint.safe_reader import read_dcp_metadata

    tmp, _ = runs
    root = tmp / "uninterrupted" / "checkpoints"
    keys = read_dcp_metadata(root / layout.step_dir_name(layout.latest_step(root)) / ".metadata").state_dict_metadata
    opt = [k for k in keys if k.startswith("optimizer/") and ("exp_avg" in k)]
    assert opt and all(any(m in k for m in ("modulation", "recurrence_gate", "step_norms")) for k in opt), opt
    # FSDP2 units: 2 prelude layers, the recurrent layer, 1 coda layer, the root. Only the root holds trainable
    # parameters (controller, gate, step norms), so each step reduce-scatters once, not five times.
    assert {r["comm/reduce_scatter"] for r in metrics(tmp / "uninterrupted")} == {1}


def test_resume_after_kill_matches_uninterrupted(runs):
    tmp, killed_at = runs
    steps = [r["step"] for r in metrics(tmp / "killed")]
    assert steps.count(1) == 1 and steps[-1] == STEPS  # the restart resumed (it did not start over at step 1)
    a, b = _losses(tmp / "uninterrupted"), _losses(tmp / "killed")
    assert [b[s] for s in range(killed_at + 1, STEPS + 1)] == [a[s] for s in range(killed_at + 1, STEPS + 1)]
    sa = load_retrofit_checkpoint(tmp / "uninterrupted" / "checkpoints").state_dict()
    sb = load_retrofit_checkpoint(tmp / "killed" / "checkpoints").state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_export_cli_of_the_trained_run(runs, tmp_path):
    from transformers import AutoModelForCausalLM

    tmp, _ = runs
    out = tmp_path / "hf"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "titanloop.retrofit",
            "export",
            "--checkpoint",
            str(tmp / "uninterrupted" / "checkpoints"),
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    ids = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(0))
    model = load_retrofit_checkpoint(tmp / "uninterrupted" / "checkpoints")
    with torch.no_grad():
        hf = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
        torch.testing.assert_close(hf(ids).logits, model(ids, return_logits="last").logits, rtol=1e-5, atol=1e-5)
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "titanloop.retrofit",
            "export",
            "--checkpoint",
            str(tmp_path),
            "--out",
            str(tmp_path / "x"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 2 and bad.stderr.startswith("error:") and len(bad.stderr.strip().splitlines()) == 1
