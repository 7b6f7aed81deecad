"""The training config: TOML + command-line overrides, and one-line errors before any process group."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from titanloop.config_errors import ConfigError
from titanloop.train.config import load_config, parse_overrides

REPO = Path(__file__).resolve().parents[1]
DEBUG = REPO / "train_configs" / "debug.toml"
OURO = REPO / "train_configs" / "ouro_1p4b.toml"


def test_debug_and_ouro_configs_load():
    cfg = load_config(DEBUG, world_size=2)
    assert cfg.model.preset == "debug-tiny" and cfg.data.kind == "synthetic_text"
    ouro = load_config(OURO, world_size=64).looplm
    assert (ouro.n_layers, ouro.hidden_size, ouro.n_heads, ouro.ffn_hidden_size, ouro.vocab_size, ouro.n_loops) == (
        24,
        2048,
        16,
        5632,
        49152,
        4,
    )
    assert 1.3e9 < ouro.param_count() < 1.5e9


def test_every_field_is_overridable_from_the_command_line():
    cfg = load_config(
        DEBUG,
        [
            "--training.steps",
            "10",
            "--optimizer.betas",
            "[0.8, 0.9]",
            "--loop_sampler.n_loops=3",
            "--objective.beta",
            "0.05",
            "--metrics.wandb",
            "offline",
            "--data.seed",
            "7",
            "--loop_sampler.kind",
            "poisson",
            "--parallelism.activation_checkpoint",
            "loop",
        ],
        world_size=1,
    )
    assert cfg.training.steps == 10 and cfg.optimizer.betas == [0.8, 0.9] and cfg.looplm.n_loops == 3
    assert cfg.objective.beta == 0.05 and cfg.metrics.wandb == "offline" and cfg.data.seed == 7
    assert cfg.loop_sampler.kind == "poisson" and cfg.parallelism.activation_checkpoint == "loop"
    assert parse_overrides(["--data.kind", "mds"]) == {"data": {"kind": "mds"}}


@pytest.mark.parametrize(
    "overrides, world, needle",
    [
        (["--training.stepz", "3"], 1, "[training] has unknown key(s) ['stepz']"),
        (["--trainingg.steps", "3"], 1, "unknown section 'trainingg'"),
        (["--model.hiden_size", "3"], 1, "[model] has unknown key(s) ['hiden_size']"),
        (["--training.steps", "ten"], 1, "training.steps='ten' is invalid: expected an integer"),
        (["--parallelism.tp", "2"], 3, "parallelism.tp=2 is invalid: expected a divisor of the world size 3"),
        (["--parallelism.dp_shard", "3"], 4, "parallelism.dp_shard=3 is invalid"),
        (["--parallelism.tp", "8"], 8, "a divisor of model.n_heads=4"),
        (["--training.global_batch_size", "10"], 4, "a multiple of micro_batch_size * dp"),
        (["--objective.name", "stage3"], 1, "objective.name='stage3' is invalid"),
        (["--data.kind", "parquet"], 1, "data.kind='parquet' is invalid"),
        (["--metrics.wandb", "maybe"], 1, "metrics.wandb='maybe' is invalid"),
    ],
)
def test_bad_input_is_one_line_config_error(overrides, world, needle):
    with pytest.raises(ConfigError) as e:
        load_config(DEBUG, overrides, world_size=world)
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("version, ok", [("2.11.0+cu130", False), ("2.12.0", True), ("2.14.1", True)])
def test_tensor_parallel_is_refused_on_a_torch_that_cannot_run_it(monkeypatch, version, ok):
    """torch 2.11 (the GPU machine's) fails in the first TP forward, at the exit gate's linear on the sequence-sharded
    stream; the config says so in one line before any process group. One GPU (tp = 1) runs on every torch."""
    import torch

    monkeypatch.setattr(torch, "__version__", version)
    assert load_config(DEBUG, world_size=2).parallelism.tp == 1
    if ok:
        assert load_config(DEBUG, ["--parallelism.tp", "2"], world_size=2).parallelism.tp == 2
        return
    with pytest.raises(ConfigError) as e:
        load_config(DEBUG, ["--parallelism.tp", "2"], world_size=2)
    assert "torch 2.11.0+cu130: tensor parallelism needs torch >= 2.12" in str(e.value) and "\n" not in str(e.value)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[training\nsteps = 1\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)
    extra = tmp_path / "extra.toml"
    extra.write_text("[optimiser]\nlr = 1.0\n")
    with pytest.raises(ConfigError, match=r"unknown section\(s\) \['optimiser'\]"):
        load_config(extra)


def _cli(*args, world_size="1"):
    env = dict(os.environ, WORLD_SIZE=world_size)
    return subprocess.run(
        [sys.executable, "-m", "titanloop.train", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )


def test_cli_errors_before_any_process_group():
    """Bad input exits 2 with one `error:` line, without torchrun, MASTER_ADDR or a process group."""
    for args, world, needle in [
        (["--config", "train_configs/missing.toml"], "1", "does not exist"),
        (["--config", str(DEBUG), "--parallelism.tp", "3"], "4", "parallelism.tp=3"),
        ([], "1", "no config given"),
    ]:
        proc = _cli(*args, world_size=world)
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], proc.stderr


def test_cli_help():
    proc = _cli("--help")
    assert proc.returncode == 0 and "--training.steps" in proc.stdout and "Sections:" in proc.stdout
