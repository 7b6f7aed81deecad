"""Validation in the training loop (titanloop.train.validation) through the real trainer on 2 CPU ranks:

- a run with validation on trains bitwise like one with it off (every logged training number), and a resumed
  run repeats the validated run bitwise (training numbers and validation numbers);
- the val/ numbers equal `python -m titanloop.eval sweep` on the checkpoint of the same step (held-out split of
  a synthetic task, and held-out synthetic text), under FSDP2 (dp 2), tensor parallelism (dp 1 x tp 2) and
  DeepSpeed ZeRO-3 (dp 2);
- config errors are one line naming the field.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from titanloop.config_errors import ConfigError
from titanloop.train.config import load_config

from launch import DEBUG, REPO, metrics, override_args, train

TASK = {"kind": "synthetic_task", "task": "compose", "task_options": {"n_entities": 16, "n_relations": 4, "hops": 4}}
TASK_DATA = {f"data.{k}": v for k, v in TASK.items()}
NOT_COMPARED = {"tokens_per_s", "tflops", "mfu", "val/seconds"}  # wall-clock figures


def launch(run_dir: Path, overrides: dict) -> str:
    return train(run_dir, {"metrics.log_freq": 1, "metrics.wandb": "off", **overrides}).stdout


def training_part(rec: dict) -> dict:
    return {
        k: v for k, v in rec.items() if k not in NOT_COMPARED and not k.startswith("val/") and not k.startswith("time/")
    }


def test_config_errors_name_the_field():
    cfg = load_config(DEBUG, ["--validation.enable", "true"])
    assert cfg.validation.held_out.kind == "synthetic_text" and cfg.validation.held_out.seed == cfg.data.seed + 1
    assert cfg.validation.loop_counts(cfg.loop_sampler.n_loops, cfg.looplm) == [1, 2, 3, 4, 8]
    task = load_config(DEBUG, override_args({"validation.enable": True, **TASK_DATA}))
    assert task.validation.held_out.split == "eval" and task.validation.held_out.task == "compose"
    for args, field in [
        (["--validation.freq", "0"], "validation.freq"),
        (["--validation.steps", "0"], "validation.steps"),
        (["--validation.q", "[1.5]"], "validation.q"),
        (["--validation.loops", "[0, 2]"], "validation.loops"),
        (["--data.kind", "mds", "--data.sources", '[{path = "x"}]'], "validation.data"),
    ]:
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            load_config(DEBUG, ["--validation.enable", "true", *args])
    off = load_config(DEBUG, ["--data.kind", "mds", "--data.sources", '[{path = "x"}]'])  # off: no held-out set needed
    assert not off.validation.enable


@pytest.mark.slow
def test_validation_does_not_change_training_and_resumes_bitwise(tmp_path):
    common = {
        "training.steps": 8,
        "checkpoint.enable": True,
        "checkpoint.interval": 3,
        "checkpoint.keep_latest_k": 3,
        "checkpoint.mode": "sync",
        "objective.jsrr_weight": 0.1,
    }
    val = {**common, "validation.enable": True, "validation.freq": 3, "validation.steps": 2}
    launch(tmp_path / "off", common)
    out = launch(tmp_path / "on", val)
    assert out.count("val  ") == 3, out  # steps 3, 6 and the last step 8
    off, on = metrics(tmp_path / "off"), metrics(tmp_path / "on")
    assert [r["step"] for r in off] == [r["step"] for r in on] == list(range(1, 9))
    assert [training_part(r) for r in on] == [training_part(r) for r in off]  # bitwise: floats compared exactly
    assert {r["step"] for r in on if "val/loss/loop_4" in r} == {3, 6, 8}

    # resume the validated run from step 3: steps 4..8 again, training and validation numbers bitwise
    for step in (6, 8):
        shutil.rmtree(tmp_path / "on" / "checkpoints" / f"step-{step:08d}")
    launch(tmp_path / "on", val)
    again = metrics(tmp_path / "on")[8:]
    assert [r["step"] for r in again] == list(range(4, 9))
    strip = lambda r: {k: v for k, v in r.items() if k not in NOT_COMPARED and not k.startswith("time/")}  # noqa: E731
    assert [strip(r) for r in again] == [strip(r) for r in on[3:]]


def _eval_report(
    tmp_path: Path,
    ckpt: Path,
    data: dict,
    batch_size: int,
    max_batches: int,
    seq_len: int,
    loops: list[int],
    qs: list[float],
    t_train: int,
) -> dict:
    spec = tmp_path / "data.json"
    spec.write_text(json.dumps(data))
    cmd = [
        sys.executable,
        "-m",
        "titanloop.eval",
        "sweep",
        str(ckpt),
        "--data",
        str(spec),
        "--out",
        str(tmp_path / "eval"),
        "--device",  # the trainer here runs on CPU ranks in float32: compare with the CLI there too
        "cpu",
        "--dtype",
        "float32",
        "--batch-size",
        str(batch_size),
        "--max-batches",
        str(max_batches),
        "--seq-len",
        str(seq_len),
        "--loops",
        ",".join(map(str, loops)),
        "--q",
        ",".join(map(str, qs)),
        "--jsrr-loops",
        "1",
        "--exit-loops",  # validation's exit depth and Q-exit are over the trained depth
        str(t_train),
    ]
    proc = subprocess.run(
        cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((tmp_path / "eval" / "report.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("data,layout", [("task", "dp2"), ("text", "dp2"), ("text", "tp2"), ("task", "zero3")])
def test_validation_equals_eval_on_the_checkpoint(tmp_path, data, layout):
    steps, val_steps, mb = 4, 3, 4
    overrides = {
        "training.steps": steps,
        "checkpoint.enable": True,
        "checkpoint.interval": steps,
        "checkpoint.mode": "sync",
        "validation.enable": True,
        "validation.freq": steps,
        "validation.steps": val_steps,
        "validation.batch_size": mb,
    }
    if data == "task":
        overrides.update(TASK_DATA)
    if layout == "tp2":
        overrides["parallelism.tp"] = 2
    if layout == "zero3":  # DeepSpeed ZeRO-3: parameters gathered by the engine's forward
        overrides.update({"parallelism.engine": "deepspeed", "parallelism.zero_stage": 3})
    run = tmp_path / "run"
    launch(run, overrides)
    val = metrics(run)[-1]
    assert val["step"] == steps
    cfg = load_config(DEBUG, override_args(overrides), world_size=2)
    dp = 1 if layout == "tp2" else 2
    loops, qs = cfg.validation.loop_counts(cfg.loop_sampler.n_loops, cfg.looplm), cfg.validation.q
    ckpt = run / "checkpoints" / f"step-{steps:08d}"
    if data == "task":  # task held-out batches: dealt round-robin to the ranks, one example per row
        spec, batch_size, max_batches = {**TASK, "split": "eval", "seed": 0}, mb, val_steps * dp
    else:  # a loader's global batches 0..steps-1, each split over the ranks
        spec, batch_size, max_batches = {"kind": "synthetic_text", "seed": 1}, mb * dp, val_steps
    report = _eval_report(
        tmp_path, ckpt, spec, batch_size, max_batches, cfg.training.seq_len, loops, qs, cfg.loop_sampler.n_loops
    )
    diffs = {}
    points = {p["loops"]: p for p in report["depth_sweep"]["points"]}
    for t in loops:
        for ours, theirs in [
            ("loss", "loss"),
            ("ppl", "perplexity"),
            ("token_acc", "token_accuracy"),
            ("seq_acc", "sequence_accuracy"),
        ]:
            diffs[f"{ours}/loop_{t}"] = (val[f"val/{ours}/loop_{t}"], points[t][theirs])
    diffs["exit_depth"] = (val["val/exit_depth"], report["diagnostics"]["exit_distribution"]["mean_exit_loop"])
    q_points = {p["param"]["q"]: p for p in report["exit_frontier"]["points"] if p["strategy"] == "q_exit"}
    for q in qs:
        for ours, theirs in [("avg_loops", "avg_loops"), ("loss", "loss"), ("token_acc", "token_accuracy")]:
            diffs[f"q{q:g}/{ours}"] = (val[f"val/q_exit/q{q:g}/{ours}"], q_points[q][theirs])
    assert val["val/tokens"] == report["data"]["scored_tokens"]
    worst = max(abs(a - b) / max(1.0, abs(b)) for a, b in diffs.values())
    print(f"{data} {layout}: {len(diffs)} numbers, largest relative difference {worst:.2e}")
    assert worst < 1e-5, {k: v for k, v in diffs.items() if abs(v[0] - v[1]) / max(1.0, abs(v[1])) >= 1e-5}
