"""The loop count T has one home, `[loop_sampler] n_loops` (issue 25).

- T is one field by construction: `model.n_loops` and `retrofit.n_loops` do not exist, and a config (file or
  command line) that still sets one, or any other moved key, is refused in one line naming its new home.
- No shipped config sets a moved key.
- Checkpoints record the trained depth (titanloop.json "trained_depth"), and loading a checkpoint gives the model
  that default depth, which evaluation, the sweep, the exit strategies and the HF export read.
- End to end: `torchrun -m titanloop.train ... --loop_sampler.n_loops 8` alone trains at T = 8, and
  `python -m titanloop.eval sweep` on its checkpoint evaluates it as trained at T = 8 (default sweep 1..16).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from titanloop.checkpoint.loading import _model_config_from_manifest, trained_depth
from titanloop.config_errors import ConfigError
from titanloop.train.config import load_config

from launch import DEBUG, REPO, SMALL_BATCH, environment, train


def test_a_moved_key_is_refused_in_one_line_naming_its_new_home(tmp_path):
    from titanloop.train.config import MOVED

    assert MOVED["model.n_loops"] == MOVED["retrofit.n_loops"] == "loop_sampler.n_loops"
    for old, new in MOVED.items():
        section, key = old.split(".")
        for overrides in ([f"--{old}", "4"], [f"--{old}", "4", f"--{new}", "4"]):  # agreeing values too
            with pytest.raises(ConfigError) as e:
                load_config(DEBUG, overrides, world_size=1)
            msg = str(e.value)
            assert msg.startswith(f"{old} has moved to {new}:") and "\n" not in msg, msg
        toml = tmp_path / f"{section}_{key}.toml"
        toml.write_text(
            DEBUG.read_text() + f"\n[{section}]\n{key} = 4\n"
            if section not in ("model", "training")
            else DEBUG.read_text().replace(f"[{section}]\n", f"[{section}]\n{key} = 4\n", 1)
        )
        with pytest.raises(ConfigError, match=f"^{old} has moved to {new}"):
            load_config(toml, world_size=1)


def test_the_sampler_alone_sets_the_model_depth_and_the_recorded_config():
    cfg = load_config(DEBUG, ["--loop_sampler.n_loops", "8"], world_size=1)
    assert cfg.looplm.n_loops == 8 and cfg.family.build().cfg.n_loops == 8
    assert "n_loops" not in cfg.to_dict()["model"] and cfg.to_dict()["loop_sampler"]["n_loops"] == 8
    with pytest.raises(ConfigError, match=r"loop_sampler\.n_loops=20.*model\.max_loops=16"):
        load_config(DEBUG, ["--loop_sampler.n_loops", "20"], world_size=1)
    deep = load_config(DEBUG, ["--loop_sampler.n_loops", "20", "--model.max_loops", "24"], world_size=1)
    assert (deep.looplm.n_loops, deep.looplm.max_loops) == (20, 24)


def test_no_shipped_config_sets_a_moved_key():
    from titanloop.train.config import MOVED

    configs = sorted((REPO / "train_configs").rglob("*.toml")) + sorted((REPO / "experiments").rglob("*.toml"))
    assert len(configs) >= 14
    for path in configs:
        raw = tomllib.loads(path.read_text())
        for old, new in MOVED.items():
            section, key = old.split(".")
            assert key not in raw.get(section, {}), f"{path}: {old} (its home is {new})"


def test_loading_a_checkpoint_gives_the_model_its_trained_depth():
    manifest = {
        "config": {"model": {"preset": "debug-tiny", "n_loops": 4}, "loop_sampler": {"kind": "fixed", "n_loops": 4}},
        "trained_depth": {"kind": "fixed", "n_loops": 8, "min": 8, "max": 8},
    }
    assert _model_config_from_manifest(manifest, Path("x")).n_loops == 8  # the recorded depth wins
    # written before trained_depth was recorded: the loop sampler trained the model (the model section could lie)
    old = {
        "config": {
            "model": {"preset": "debug-tiny", "n_loops": 4},
            "loop_sampler": {"kind": "uniform", "n_loops": 6, "min_sampled": 2, "max_sampled": 6},
        }
    }
    assert trained_depth(old) == {"kind": "uniform", "n_loops": 6, "min": 2, "max": 6}
    assert _model_config_from_manifest(old, Path("x")).n_loops == 6
    deep = {"config": {"model": {"preset": "debug-tiny"}}, "trained_depth": {"kind": "fixed", "n_loops": 24}}
    cfg = _model_config_from_manifest(deep, Path("x"))
    assert (cfg.n_loops, cfg.max_loops) == (24, 24)


@pytest.mark.slow
def test_sampler_alone_trains_and_evaluates_at_its_depth(tmp_path):
    run_dir = tmp_path / "run"
    overrides = {
        **SMALL_BATCH,
        "training.steps": 3,
        "loop_sampler.n_loops": 8,
        "checkpoint.enable": True,
        "checkpoint.interval": 3,
        "metrics.log_freq": 1,
    }
    assert [r["n_loops"] for r in train(run_dir, overrides).rows] == [8, 8, 8]
    manifest = json.loads((run_dir / "checkpoints" / "step-00000003" / "titanloop.json").read_text())
    assert manifest["trained_depth"] == {"kind": "fixed", "n_loops": 8, "min": 8, "max": 8}

    data = tmp_path / "data.json"
    data.write_text(json.dumps({"kind": "synthetic_text", "seed": 1}))
    out = tmp_path / "eval"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "titanloop.eval",
            "sweep",
            str(run_dir / "checkpoints"),
            "--data",
            str(data),
            "--out",
            str(out),
            "--batch-size",
            "2",
            "--max-batches",
            "1",
            "--no-diagnostics",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env=environment(),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["depth_sweep"]["trained_loops"] == 8
    # default sweep: log-spaced to 64, past the trained T = 8 (which it includes)
    assert report["depth_sweep"]["loops"] == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]
    assert report["model"]["config"]["n_loops"] == 8
