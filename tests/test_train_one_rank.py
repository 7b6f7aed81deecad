"""One process: the plain module when FSDP2 has nothing to do, its CPU threads, tied weights after a meta build,
the run summary's model name, and checkpoints that move between one rank (plain) and two (FSDP2)."""

from __future__ import annotations

import shutil

import pytest
import torch

from titanloop.checkpoint import layout
from titanloop.model import LoopLM, preset
from titanloop.model.config import ModelSection
from titanloop.model.init import materialize
from titanloop.parallel.parallelize import needs_fsdp
from titanloop.train.__main__ import cpu_threads_per_process
from titanloop.train.config import load_config

from launch import REPO, SMALL_BATCH, train


@pytest.mark.parametrize(
    "dp, tp, param_dtype, float8, wrapped",
    [
        (1, 1, torch.float32, "off", False),  # one CPU process: the plain module
        (2, 1, torch.float32, "off", True),  # sharding
        (1, 2, torch.float32, "off", True),  # composes with the tp mesh
        (1, 1, torch.bfloat16, "off", True),  # mixed precision: bf16 compute from fp32 masters (every GPU run)
        (1, 1, torch.float32, "tensorwise", True),  # float8 weights
    ],
)
def test_fsdp_wraps_only_when_it_has_work(dp, tp, param_dtype, float8, wrapped):
    assert needs_fsdp(dp, tp, param_dtype, torch.float32, float8) is wrapped


def test_meta_build_keeps_tied_weights_tied():
    """to_empty gives each owner of a plain meta parameter its own tensor: materialize must tie them again (else
    a one-rank run would train an untied LM head)."""
    cfg = preset("debug-tiny", tie_embeddings=True)
    torch.manual_seed(3)
    full = LoopLM(cfg)
    torch.manual_seed(3)
    with torch.device("meta"):
        meta = LoopLM(cfg)
    materialize(meta, "cpu")
    assert meta.lm_head.weight is meta.embed_tokens.weight
    assert len({id(p) for p in meta.parameters()}) == len(list(meta.parameters()))
    for (name, a), b in zip(full.state_dict().items(), meta.state_dict().values()):
        assert torch.equal(a, b), name


def test_cpu_threads_share_the_cores_among_local_processes(monkeypatch):
    cores = len(__import__("os").sched_getaffinity(0))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert cpu_threads_per_process() == cores  # one process: every core (torchrun leaves OMP_NUM_THREADS unset)
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores * 2))
    assert cpu_threads_per_process() == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_threads_per_process() == 3  # the user's (or torchrun's) setting wins


def test_run_summary_names_a_preset_only_when_one_was_used():
    nanogpt = load_config(REPO / "train_configs/nanogpt_shakespeare_char.toml").family.describe()
    assert nanogpt == "LoopLM (4 shared layer(s) x T=1, hidden 128, 4 heads, FFN 341, vocab 67)"
    named = load_config(REPO / "train_configs/ouro_1p4b.toml").family.describe()
    assert named.startswith("LoopLM ouro-1.4b (24 shared layer(s) x T=4, hidden 2048")
    assert (
        ModelSection.from_table({"preset": "debug-tiny", "readout": "raw"})
        .describe(4)
        .startswith("LoopLM debug-tiny (")
    )  # a variant keeps the preset's shape
    reshaped = ModelSection.from_table({"preset": "debug-tiny", "n_layers": 3}).describe(4)
    assert "debug-tiny" not in reshaped and "3 shared layer(s)" in reshaped


RUN = {
    **SMALL_BATCH,
    "training.steps": 6,
    "metrics.log_freq": 1,
    "lr_scheduler.warmup_steps": 1,
    "checkpoint.enable": True,
    "checkpoint.interval": 3,
    "checkpoint.keep_latest_k": 0,
    "model.tie_embeddings": True,  # a shared parameter through both layouts
}


def resume_from_step_3(src, dst, nproc):
    """A copy of run `src` rolled back to its step-3 checkpoint, trained to step 6 on `nproc` ranks."""
    shutil.copytree(src, dst)
    shutil.rmtree(dst / "checkpoints" / layout.step_dir_name(6))
    (dst / "checkpoints" / layout.LATEST).write_text(layout.step_dir_name(3) + "\n")
    (dst / "metrics.jsonl").unlink()
    return train(dst, RUN, nproc=nproc)


@pytest.mark.slow
def test_checkpoints_move_between_one_plain_rank_and_two_fsdp_ranks(tmp_path):
    one = train(tmp_path / "one", RUN, nproc=1)
    two = train(tmp_path / "two", RUN, nproc=2)
    assert "(one rank, no FSDP2)" in one.out and "(fsdp2)" in two.out  # the run summary says which
    for step in range(1, 7):  # the same run on both layouts, up to the reduction order
        assert one.by_step[step]["loss"] == pytest.approx(two.by_step[step]["loss"], abs=2e-5)
    one_to_two = resume_from_step_3(tmp_path / "one", tmp_path / "one_to_two", 2)
    two_to_one = resume_from_step_3(tmp_path / "two", tmp_path / "two_to_one", 1)
    assert sorted(one_to_two.by_step) == sorted(two_to_one.by_step) == [4, 5, 6]  # resumed, not restarted
    for step in (4, 5, 6):
        assert one_to_two.by_step[step]["loss"] == pytest.approx(one.by_step[step]["loss"], abs=2e-5)
        assert two_to_one.by_step[step]["loss"] == pytest.approx(two.by_step[step]["loss"], abs=2e-5)
