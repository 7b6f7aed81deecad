"""The trainer's own cost per step (titanloop.train.loop, titanloop.train.step_timer), through torchrun with 2 CPU
ranks and a test-only launcher that records where the per-loop statistics are computed (tests/step_cost_driver.py):

- steps without a log line compute no per-loop statistics and all-reduce the loss alone; log steps compute and
  log them all;
- a NaN gradient injected on steps that log nothing is still caught on each of them (skipped, recorded);
- the whole-step profile (metrics.step_profile) accounts for >= 95% of the wall time of every profiled step;
- one process runs without torchrun (`python -m titanloop.train`), with no launcher to start first;
- without a trainer: the objective's loss is the same bitwise with or without statistics.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from titanloop.objectives.losses import ObjectiveConfig
from titanloop.objectives.objective import loop_objective
from titanloop.train.step_timer import PARTS

from launch import REPO, SMALL_BATCH, environment, train, trainer_args

LOG_STEPS = [1, 3, 6]  # step 1 and every metrics.log_freq = 3 steps of 6
NAN_STEPS = [2, 5]  # steps that log nothing


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("step_cost") / "run"
    overrides = {
        **SMALL_BATCH,
        "training.steps": 6,
        "metrics.log_freq": 3,
        "metrics.step_profile": True,
        "training.inject_nan_grad_steps": NAN_STEPS,
    }
    proc = train(run_dir, overrides, entry=[str(REPO / "tests" / "step_cost_driver.py")])
    seen = [json.loads((run_dir / f"step_cost.rank{r}.json").read_text()) for r in (0, 1)]
    return run_dir, proc, seen


@pytest.mark.slow
def test_steps_without_a_log_line_compute_no_statistics(run):
    _, proc, seen = run
    for rank in seen:
        assert rank["statistics"] == LOG_STEPS, rank  # one micro-batch per step: one call per log step
        reduced = {int(k): v for k, v in rank["reduced"].items()}
        assert [s for s, keys in sorted(reduced.items()) if keys] == LOG_STEPS, reduced
        assert all(reduced[s] == ["ce", "exit_prob", "gate_entropy", "hidden_rms"] for s in LOG_STEPS)
        assert all(reduced[s] == [] for s in range(1, 7) if s not in LOG_STEPS)
    rows = proc.by_step
    assert sorted(rows) == LOG_STEPS
    assert all(len(rows[s]["ce"]) == 4 and len(rows[s]["hidden_rms"]) == 4 for s in LOG_STEPS)


@pytest.mark.slow
def test_a_nan_gradient_is_caught_on_steps_that_log_nothing(run):
    run_dir, proc, _ = run
    for step in NAN_STEPS:
        assert f"step {step:5d} | non-finite gradient norm (nan): step skipped" in proc.out, proc.out[-3000:]
        records = [json.loads(p.read_text()) for p in sorted((run_dir / "nonfinite").glob(f"step-{step}.rank-*.json"))]
        assert len(records) == 2 and records[1]["nonfinite_grads"] and records[0]["nonfinite_grads"] == []
    assert sorted(p.name.split(".")[0] for p in (run_dir / "nonfinite").iterdir()) == ["step-2"] * 2 + ["step-5"] * 2
    assert proc.by_step[3]["skipped_steps"] == 1 and proc.by_step[6]["skipped_steps"] == 2


@pytest.mark.slow
def test_the_whole_step_profile_covers_the_wall_step(run):
    run_dir, proc, _ = run
    lines = [json.loads(line) for line in (run_dir / "step_profile.jsonl").read_text().splitlines()]
    startup, records = lines[0]["startup"], lines[1:]
    parts = ["process", "launcher", "mesh", "model", "engine", "data", "checkpointer", "callbacks", "pre_train"]
    assert list(startup) == parts and all(v is not None and v >= 0 for v in startup.values()), startup
    assert "[titanloop] start-up (s): process " in proc.out
    assert [r["step"] for r in records] == LOG_STEPS
    for r in records:
        assert list(r["parts"]) == list(PARTS)
        covered = sum(r["parts"].values())
        assert covered >= 0.95 * r["wall_s"], r
        assert abs(r["wall_s"] - covered - r["uncovered_s"]) < 1e-9
        # each callback's time lies inside its hook's
        for hook in ("pre_step", "post_step"):
            inside = sum(v for k, v in r["callbacks"].items() if k.startswith(hook + "/"))
            assert {k.split("/")[1] for k in r["callbacks"] if k.startswith(hook)} >= {"Metrics", "NonFinite"}
            assert inside <= r["parts"][hook] + 1e-9
    print("profile coverage per step", [round(r["covered"], 3) for r in records])
    assert sum(line.startswith("profile ") for line in proc.out.splitlines()) == len(LOG_STEPS)


@pytest.mark.slow
def test_one_process_runs_without_torchrun(tmp_path):
    run_dir = tmp_path / "run"
    overrides = {**SMALL_BATCH, "training.steps": 2, "metrics.log_freq": 1, "metrics.step_profile": True}
    args = trainer_args(REPO / "train_configs" / "debug.toml", run_dir, overrides)
    proc = subprocess.run(
        [sys.executable, "-m", "titanloop.train", *args],
        cwd=REPO,
        env=environment({"RANK": None, "WORLD_SIZE": None, "LOCAL_RANK": None, "MASTER_PORT": None}),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "world 1 = dp 1 x tp 1" in proc.stdout and "launcher n/a" in proc.stdout
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]


@pytest.mark.parametrize("name", ["stage1", "final_only"])
def test_the_loss_is_the_same_without_statistics(name):
    torch.manual_seed(0)
    t, b, s, h, v = 3, 2, 5, 8, 11
    readouts = [torch.randn(b, s, h, requires_grad=True) for _ in range(t)]
    states = [torch.randn(b, s, h) for _ in range(t)]
    gates = torch.randn(t, b, s, requires_grad=True)
    labels = torch.randint(0, v, (b, s))
    labels[0, 0] = -100
    head = torch.randn(v, h, requires_grad=True)
    cfg = ObjectiveConfig(name=name)
    with_stats, stats = loop_objective(cfg, readouts, states, gates, labels, head)
    without, none = loop_objective(cfg, readouts, states, gates, labels, head, statistics=False)
    assert none == {} and sorted(stats) == ["ce", "exit_prob", "gate_entropy", "hidden_rms"]
    assert torch.equal(with_stats, without)
    assert stats["ce"].shape == (t,)  # final_only: the loops that were not decoded are in the statistics
