"""Ouro's stage chain end to end on CPU (train_configs/tiny_chain): every stage a few steps with the real
trainer under torchrun, each starting from the previous stage's checkpoint, with its own T, β, sequence
length, RoPE base, schedule, upcycling and the exit-gate Stage II."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch

from titanloop.config_errors import ConfigError
from titanloop.data import build_dataloader
from titanloop.checkpoint.loading import load_model
from titanloop.model import LoopLM
from titanloop.recipe.stages import StageSection, previous_stage_state
from titanloop.recipe.upcycle import upcycle_state_dict
from titanloop.train.config import load_config
from titanloop.objectives import loop_objective

from launch import Finished, metrics, train

ROOT = Path(__file__).resolve().parent.parent
CHAIN = ROOT / "train_configs" / "tiny_chain"
ORDER = [
    ("stage1a", 2),
    ("stage1b_1p4b", 1),
    ("stage1b_2p6b_upcycle", 1),
    ("stage2_ct_anneal", 2),
    ("stage3_longct", 1),
    ("stage4_midtrain", 1),
    ("gate_stage2", 1),
]

pytestmark = pytest.mark.slow


def _train(workdir: Path, stage: str, nproc: int, overrides: dict | None = None, check: bool = True) -> Finished:
    """A stage's config as shipped, from `workdir` (its run dir and init_from are relative to it)."""
    return train(None, overrides, nproc=nproc, config=CHAIN / f"{stage}.toml", cwd=workdir, check=check)


def _metrics(workdir: Path, stage: str) -> list[dict]:
    return metrics(workdir / "runs" / "tiny_chain" / stage)


def _ckpt(workdir: Path, stage: str) -> Path:
    return workdir / "runs" / "tiny_chain" / stage / "checkpoints"


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("chain")
    table = []
    for stage, nproc in ORDER:
        _train(workdir, stage, nproc)
        rows = _metrics(workdir, stage)
        cfg = load_config(CHAIN / f"{stage}.toml", world_size=nproc)
        table.append(
            (
                stage,
                nproc,
                rows[0]["n_loops"],
                cfg.objective.beta,
                rows[0]["lr"],
                rows[-1]["lr"],
                rows[0]["loss"],
                rows[-1]["loss"],
            )
        )
    print("\nstage                  procs  T  beta  lr first   lr last  loss first  loss last")
    for r in table:
        print(f"{r[0]:<22} {r[1]:>5} {r[2]:>2} {r[3]:>5} {r[4]:>9.2e} {r[5]:>9.2e} {r[6]:>11.4f} {r[7]:>10.4f}")
    return workdir


def _first_step_reference(workdir: Path, stage: str, upcycle: str = "none") -> float:
    """The loss the NEW stage's first step should report: the previous stage's final weights, put into a
    model of the new stage's config (its T, RoPE base, ...), on the first batch the new stage's loader gives."""
    cfg = load_config(CHAIN / f"{stage}.toml", world_size=1)
    prev = load_model(workdir / cfg.stage.init_from)
    model = LoopLM(cfg.looplm)
    state = prev.state_dict()
    model.load_state_dict(upcycle_state_dict(state, upcycle) if upcycle != "none" else state)
    t = cfg.training
    loader = build_dataloader(
        dataclasses.replace(cfg.data, prefetch=0),
        seq_len=t.seq_len,
        micro_batch_size=t.micro_batch_size,
        global_batch_size=t.global_batch_size,
        dp_rank=0,
        dp_world=1,
        vocab_size=cfg.looplm.vocab_size,
    )
    losses = []
    with torch.no_grad():
        for _ in range(loader.grad_accum_at(0)):
            b = next(loader)
            out = model(b["input_ids"], cfg.loop_sampler.n_loops, doc_ids=b["doc_ids"])
            loss, _ = loop_objective(
                cfg.objective, out.readouts, out.states, out.gate_logits, b["labels"], model.lm_head.weight
            )
            losses.append(float(loss))
    return sum(losses) / len(losses)


def test_every_stage_trains_from_the_previous_checkpoint(chain):
    for stage, _ in ORDER:
        rows = _metrics(chain, stage)
        assert [r["step"] for r in rows] == [1, 2, 3, 4]
        assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
        assert (_ckpt(chain, stage) / "latest").is_file()
    # the configured loop counts and schedules are what ran
    assert _metrics(chain, "stage1a")[0]["n_loops"] == 8 and _metrics(chain, "stage1b_1p4b")[0]["n_loops"] == 4
    s2 = _metrics(chain, "stage2_ct_anneal")
    assert s2[0]["lr"] == pytest.approx(3e-3) and s2[-1]["lr"] < s2[0]["lr"]  # cosine decay within the stage


@pytest.mark.parametrize(
    "stage,upcycle",
    [
        ("stage1b_1p4b", "none"),  # T 8 -> 4, 2 ranks -> 1
        ("stage2_ct_anneal", "none"),  # RoPE 10K -> 40K, seq 64 -> 128
        ("stage1b_2p6b_upcycle", "stack"),
    ],
)  # 2 -> 4 looped layers
def test_first_step_loss_is_the_loaded_models(chain, stage, upcycle):
    logged = _metrics(chain, stage)[0]["loss"]
    assert logged == pytest.approx(_first_step_reference(chain, stage, upcycle), rel=1e-5, abs=1e-5)


def test_upcycled_stage_has_twice_the_layers(chain):
    before = load_model(_ckpt(chain, "stage1a"))
    after = load_model(_ckpt(chain, "stage1b_2p6b_upcycle"))
    assert (before.cfg.n_layers, after.cfg.n_layers) == (2, 4)


def test_gate_stage2_changes_only_the_exit_gate(chain):
    lm = load_model(_ckpt(chain, "stage4_midtrain")).state_dict()
    gated = load_model(_ckpt(chain, "gate_stage2")).state_dict()
    changed = sorted(k for k in lm if not torch.equal(lm[k], gated[k]))
    assert changed == ["early_exit_gate.bias", "early_exit_gate.weight"]


def test_resuming_inside_a_stage_ignores_init_from(chain, tmp_path):
    """A stage with checkpoints of its own resumes from them, not from the previous stage."""
    work = tmp_path / "w"
    shutil.copytree(chain / "runs", work / "runs")
    # longer stage: the LR schedule's shape changes, which is refused unless allowed explicitly
    proc = _train(work, "stage2_ct_anneal", 1, {"training.steps": 6}, check=False)
    assert proc.returncode != 0  # the worker exits 2; torchrun reports it as 1
    assert "error: lr_scheduler changed since the checkpoint (total_steps: 4 -> 6)" in proc.stderr
    assert [r["step"] for r in _metrics(work, "stage2_ct_anneal")] == [1, 2, 3, 4]
    _train(work, "stage2_ct_anneal", 1, {"training.steps": 6, "lr_scheduler.allow_schedule_change": True})
    rows = _metrics(work, "stage2_ct_anneal")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]  # steps 5-6 appended after resuming at step 4


def test_bad_previous_checkpoint_fails_with_one_line_and_writes_nothing(chain, tmp_path):
    work = tmp_path / "w"
    shutil.copytree(chain / "runs", work / "runs")
    # wrong layer count without the upcycle step
    other = {"stage.upcycle": "none", "training.run_dir": "runs/tiny_chain/other"}
    proc = _train(work, "stage1b_2p6b_upcycle", 1, other, check=False)
    assert proc.returncode != 0
    assert "set stage.upcycle" in proc.stderr + proc.stdout
    assert not (work / "runs/tiny_chain/other/checkpoints").exists() or not any(
        (work / "runs/tiny_chain/other/checkpoints").iterdir()
    )
    # a missing previous checkpoint
    missing = {"stage.init_from": "runs/nowhere/checkpoints", "training.run_dir": "runs/tiny_chain/other2"}
    proc = _train(work, "stage1b_1p4b", 1, missing, check=False)
    assert proc.returncode != 0 and "does not exist" in proc.stderr + proc.stdout


def test_stage_errors_name_what_differs(chain):
    model = LoopLM(
        load_config(CHAIN / "stage1b_1p4b.toml", world_size=1).looplm.replace(hidden_size=128, ffn_hidden_size=352)
    )
    with pytest.raises(ConfigError, match="embed_tokens.weight.*shape"):
        previous_stage_state(StageSection(init_from=str(_ckpt(chain, "stage1a"))), model)
    with pytest.raises(ConfigError, match="stage.upcycle"):
        StageSection(upcycle="stack").validate()
