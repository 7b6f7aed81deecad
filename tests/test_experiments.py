"""Smoke runs of every experiment in experiments/ (CI): each command trains its models for a few steps through
`torchrun -m titanloop.train`, evaluates them and writes results.json / results.md / a plot. A smoke run checks
the pipeline, never the paper's result (results.json says reproduced = null)."""

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from titanloop.checkpoint import layout

REPO = Path(__file__).resolve().parents[1]
EXPERIMENTS = {  # name -> (plot file, number of result rows in a smoke run, run dirs trained)
    "readout_blind_spot": ("final_norm.png", 3, ["terminal_norm_s0", "perloop_norm_s0", "perloop_raw_s0"]),
    "stars": ("accuracy_vs_loops.png", 2, ["plain_s0", "stars_s0"]),
    "dice": ("accuracy_vs_bits.png", 4, ["endpoint_s0", "dense_s0"]),
    "mano": ("accuracy_by_ops.png", 2, ["1x4_s0", "1x1_s0"]),
    "exit_gate": ("accuracy_vs_avg_loops.png", 4, ["stage1_s0", "stage2_s0"]),
    "blind_spot_prenorm": (
        "final_norm_by_step.png",
        4,
        ["rmsnorm_s0", "raw_s0", "rmsnorm_penalty_s0", "sandwich_s0"],
    ),
    "stars_depth": ("loss_vs_loops.png", 3, ["fixed_s0", "sampled_s0", "jsrr_s0"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(EXPERIMENTS))
def test_experiment_smoke(name, tmp_path):
    out = tmp_path / name
    proc = subprocess.run(
        [sys.executable, "-m", f"experiments.{name}", "--smoke", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    plot, n_rows, runs = EXPERIMENTS[name]
    result = json.loads((out / "results.json").read_text())
    assert result["schema"] == "titanloop.experiments/v1" and result["name"] == name
    assert result["smoke"] is True and result["reproduced"] is None and result["paper"] and result["verdict"]
    assert len(result["rows"]) == n_rows and all(set(result["columns"]) <= set(r) for r in result["rows"])
    assert (out / "results.md").read_text().startswith("# ") and (out / plot).stat().st_size > 1000
    for run in runs:  # every model really trained: a published final checkpoint and finite logged losses
        step = layout.latest_step(out / run / "checkpoints")
        assert step == 6, f"{run}: latest checkpoint {step}"
        logged = [json.loads(line) for line in (out / run / "metrics.jsonl").read_text().splitlines()]
        assert logged and all(math.isfinite(m["loss"]) for m in logged)
    # the per-loop training-CE curves of every run, beside the table (issue 26 item 4)
    curves = json.loads((out / "loss_curves.json").read_text())
    for run in runs:
        logged = [json.loads(line) for line in (out / run / "metrics.jsonl").read_text().splitlines()]
        assert curves[run]["step"] == sorted({m["step"] for m in logged if "ce" in m}) and curves[run]["ce"], run
    assert (out / "loss_curves.png").stat().st_size > 1000 and "loss_curves.png" in (out / "results.md").read_text()


def test_train_log_is_written_while_the_run_goes_on(tmp_path, monkeypatch):
    """experiments.common.train writes each line of the training output to run_dir/train.log as it arrives, so a
    long experiment can be followed with `tail -f`; the fake trainer checks the file before printing its next line."""
    from experiments import common

    run_dir = tmp_path / "run"
    seen = []

    class FakeTrainer:
        def __init__(self, *args, **kwargs):
            self.stdout = self._lines()

        def _lines(self):
            for i in range(3):
                if i:
                    seen.append((run_dir / "train.log").read_text())
                yield f"step {i}\n"

        def wait(self):
            return 0

    monkeypatch.setattr(common.subprocess, "Popen", FakeTrainer)
    common.train("train_configs/debug.toml", run_dir)
    assert seen == ["step 0\n", "step 0\nstep 1\n"]


def test_keep_finished_keeps_only_finished_runs(tmp_path, monkeypatch):
    """--keep-finished: a run dir with train_seconds (written last) is kept untouched; one without it (an interrupted
    run) and any run without the flag train afresh (the fake trainer counts the launches)."""
    from experiments import common

    launches = []

    class FakeTrainer:
        def __init__(self, *args, **kwargs):
            launches.append(1)
            self.stdout = iter(["step 1\n"])

        def wait(self):
            return 0

    monkeypatch.setattr(common.subprocess, "Popen", FakeTrainer)
    finished, interrupted = tmp_path / "finished", tmp_path / "interrupted"
    for d in (finished, interrupted):
        d.mkdir()
        (d / "weights").write_text("kept")
    (finished / "train_seconds").write_text("1.0\n")
    common.train("train_configs/debug.toml", finished, keep_finished=True)
    assert launches == [] and (finished / "weights").is_file()
    common.train("train_configs/debug.toml", interrupted, keep_finished=True)  # no checkpoint: afresh
    assert launches == [1] and not (interrupted / "weights").exists()
    common.train("train_configs/debug.toml", finished)
    assert launches == [1, 1] and not (finished / "weights").exists()
    # train_many passes an experiment's flags (run_options) to every job
    job = [("train_configs/debug.toml", finished, None)]
    common.train_many(job, **common.run_options(argparse.Namespace(nproc=1, keep_finished=True)))
    assert launches == [1, 1]
    common.train_many(job, **common.run_options(argparse.Namespace(nproc=1, keep_finished=False)))
    assert launches == [1, 1, 1]


@pytest.mark.slow
def test_keep_finished_resumes_an_interrupted_run(tmp_path, capsys):
    """--keep-finished resumes an interrupted run (a checkpoint, no train_seconds) from its newest checkpoint through
    the real entry point, and trains it afresh when the experiment now asks for another config. The interruption is
    made by hand: a 4-step run checkpointed at steps 2 and 4 loses its step-4 checkpoint and its train_seconds."""
    from experiments import common

    run = tmp_path / "run"
    over = {"training.steps": 4, "checkpoint.interval": 2, "metrics.log_freq": 1}

    def interrupt():
        import shutil

        shutil.rmtree(run / "checkpoints" / layout.step_dir_name(4))
        (run / "train_seconds").unlink()
        assert layout.latest_step(run / "checkpoints") == 2

    common.train("train_configs/debug.toml", run, over)
    interrupt()
    common.train("train_configs/debug.toml", run, over, keep_finished=True)
    assert "from its checkpoint at step 2" in capsys.readouterr().out
    assert [m["step"] for m in common.metrics(run)] == [1, 2, 3, 4, 3, 4]  # the log of both attempts
    assert layout.latest_step(run / "checkpoints") == 4
    interrupt()
    common.train("train_configs/debug.toml", run, {**over, "optimizer.lr": 5e-3}, keep_finished=True)
    assert "trained with another [optimizer]: training it afresh" in capsys.readouterr().out
    assert [m["step"] for m in common.metrics(run)] == [1, 2, 3, 4]


def test_mano_scores_every_tree_of_a_small_eval_split():
    """experiments.mano asks for min(count, n_scored(n)) distinct eval trees: n_scored is exactly how many exist
    (the held-out trees; below heldout_min_ops the trained table), so a small space is scored whole."""
    from experiments.mano.__main__ import MAX_OPS, TASK_OPTIONS, n_scored
    from titanloop.config_errors import ConfigError
    from titanloop.data.synthetic_tasks import build_task, eval_examples

    small = [n for n in range(1, MAX_OPS + 1) if n_scored(n) < 10**9]
    if not small:
        pytest.skip(f"experiments/mano/base.toml's task {TASK_OPTIONS} has no eval split small enough to count")
    for n in small:
        count = n_scored(n)
        task = build_task("mano", **{**TASK_OPTIONS, "eval_ops": n})
        assert len({tuple(p) for p, _ in eval_examples(task, count)}) == count
        with pytest.raises(ConfigError, match="distinct held-out"):
            eval_examples(task, count + 1)


@pytest.mark.slow
def test_real_text_smoke(tmp_path):
    """experiments.real_text at 6 steps a model, one corpus: the looping table (3 models x T = 1..8 from the whole
    held-out split) and the three directions, each with its results.json / results.md."""
    out = tmp_path / "real_text"
    cmd = [sys.executable, "-m", "experiments.real_text", "--smoke", "--corpora", "shakespeare_char", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    looping = json.loads((out / "looping" / "results.json").read_text())
    assert looping["smoke"] is True and looping["reproduced"] is None and len(looping["rows"]) == 3
    per = looping["per_corpus"]["shakespeare_char"]
    assert set(per["heldout"]) == {"looped", "once", "dense"} and all(len(r[0]) == 8 for r in per["heldout"].values())
    directions = json.loads((out / "directions" / "results.json").read_text())
    assert {r["direction"] for r in directions["rows"]} == {"readout blind spot", "Ouro Q-exit", "STARS"}
    assert len(directions["q_exit"]["points"]) == 9 and all(
        v[0] > 0 for v in directions["blind_spot"]["final_norm"].values()
    )


@pytest.mark.slow
def test_depth_smoke(tmp_path):
    """experiments.depth at 6 steps: one arm with the depth tools, tuned on a split carved from the training text
    (never the reported held-out split), scored at the log-spaced T = 1..64."""
    out = tmp_path / "depth"
    cmd = [sys.executable, "-m", "experiments.depth", "--part", "tune", "--smoke", "--only", "depth", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (row,) = json.loads((out / "tuning.json").read_text())["rows"]
    assert [k for k in row if k.startswith("T=")] == [f"T={t}" for t in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)]
    assert all(math.isfinite(row[k]) for k in row if k.startswith("T="))
    # how far the decoded state moves: a step at every swept T > 1, a distance at every T past the reference
    from experiments.depth.__main__ import LOOPS, reference_depth

    drift = row["state_drift"]
    assert list(drift["step"]) == [f"T={t}" for t in LOOPS[1:]]
    assert list(drift["from_reference"]) == [f"T={t}" for t in LOOPS if t > reference_depth("depth")]
    values = [v for part in drift.values() for v in part.values()]
    assert all(0 <= v < 3 for v in values) and max(values) > 0  # relative distances between normed states
    # the tuning split is tinyshakespeare's training text (its first 90% of characters) split again: its two parts
    # hold exactly those characters (plus one end-of-text token each), none of the reported held-out split
    n = len((REPO / "data" / "tinyshakespeare.txt").read_text())
    tokens = [json.loads((out / "tuning_split" / s / "manifest.json").read_text())["tokens"] for s in ("train", "val")]
    assert sum(tokens) == int(0.9 * n) + 2 and tokens[1] == int(0.9 * n) - int(0.9 * int(0.9 * n)) + 1


@pytest.mark.parametrize(
    "flags,named", [(["--only", "nope"], "--only"), (["--arm", "nope"], "--arm"), (["--corpora", "nope"], "--corpora")]
)
def test_depth_refuses_an_unknown_name_naming_its_flag(flags, named):
    cmd = [sys.executable, "-m", "experiments.depth", "--part", "record", *flags]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False, timeout=300)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert (
        proc.stderr.strip().splitlines() == [proc.stderr.strip()] and f"error: {named} 'nope' is unknown" in proc.stderr
    )


@pytest.mark.parametrize(
    "name,flags",
    [
        ("depth", ["--part", "--only", "--arm", "--corpora"]),
        ("real_text", ["--part", "--corpora", "--only"]),
        ("blind_spot_prenorm", ["--steps"]),
        ("ouroboros_retrofit", ["--jobs", "--reuse-dense"]),
    ],
)
def test_help_lists_an_experiments_own_flags(name, flags, capsys):
    """--help of a driver with flags of its own lists them beside the shared ones, each with what it does, and an
    unknown flag is refused rather than passed on."""
    import importlib

    main = importlib.import_module(f"experiments.{name}.__main__").main
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    for flag in [*flags, "--seeds", "--keep-finished"]:
        assert f"  {flag} " in text, flag
    with pytest.raises(SystemExit) as done:
        main(["--no-such-flag"])
    assert done.value.code == 2 and "unrecognized arguments: --no-such-flag" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags,says",
    [
        (["--seeds", "a"], "argument --seeds: expected comma-separated integers such as 1,2,3, got 'a'"),
        (["--seeds", "1,2,1"], "argument --seeds: '1,2,1' names a seed twice"),
        (["--parallel", "0"], "argument --parallel: expected an integer >= 1, got '0'"),
        (["--nproc", "two"], "argument --nproc: expected an integer >= 1, got 'two'"),
    ],
)
def test_shared_flags_refuse_bad_values_in_one_line(flags, says, capsys):
    """A bad --seeds / --parallel / --nproc is one line naming the flag and what it takes (not argparse's
    '<lambda>'), exit 2; a seed given twice would train two runs into one directory."""
    from experiments import common

    with pytest.raises(SystemExit) as done:
        common.parse_args("depth", "", flags)
    err = capsys.readouterr().err.strip().splitlines()
    assert done.value.code == 2 and says in err[-1]
    assert common.parse_args("depth", "", ["--seeds", "3,1", "--parallel", "2"]).seeds == [3, 1]


def test_blind_spot_runs_checkpoint_every_eighth_at_any_length():
    """The held-out curve and the pass rule's "still growing" need a checkpoint every steps / 8: at the paper's
    default 8,000 steps too (it was left to experiments.common.train, which checkpoints the last step only)."""
    from experiments.blind_spot_prenorm.__main__ import STEPS, run_length

    for steps in (STEPS, 1000):
        assert run_length(steps, False) == {
            "training.steps": steps,
            "checkpoint.interval": steps // 8,
            "validation.freq": steps,
        }
    assert run_length(6, True)["checkpoint.interval"] == 3


def test_an_interrupted_run_resumes_only_with_the_config_it_was_trained_with(tmp_path, capsys):
    """_resumable compares the config a run's checkpoint saved with the one the experiment asks for: equal resumes;
    another value does not; a field the checkpoint predates (added to titanloop since) resumes only where the
    experiment leaves it at its default, which is what the older code ran."""
    import json

    from experiments import common
    from titanloop.train.config import load_config

    run = tmp_path / "run"
    config = common.REPO / "train_configs" / "debug.toml"
    args = common.override_args({"training.run_dir": str(run), "training.steps": 4})
    saved = json.loads(json.dumps(load_config(config, args, world_size=1).to_dict()))
    del saved["objective"]["fixed_point_weight"]  # as a checkpoint written before the field existed
    step = run / "checkpoints" / layout.step_dir_name(2)
    step.mkdir(parents=True)
    (step / layout.MANIFEST).write_text(json.dumps({"format": 1, "files": {}, "config": saved}))
    assert common._resumable(run, config, args, 1)
    assert "predates objective.fixed_point_weight, asked for at the defaults" in capsys.readouterr().out
    for more, section in (
        (["--objective.fixed_point_weight", "0.5"], "objective"),
        (["--optimizer.lr", "0.5"], "optimizer"),
    ):
        assert not common._resumable(run, config, args + more, 1)
        assert f"trained with another [{section}]: training it afresh" in capsys.readouterr().out
    assert not common._resumable(tmp_path / "none", config, args, 1)
