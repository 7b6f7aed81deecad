"""A W&B failure (e.g. its service killed by a preemption SIGTERM) never stops training or the save after it."""

from types import SimpleNamespace

from titanloop.train.metrics import MetricsLogger


class _DeadRun:
    def __init__(self):
        self.calls = 0

    def log(self, *a, **k):
        self.calls += 1
        raise BrokenPipeError("wandb service is gone")

    def finish(self):
        raise AssertionError("finish must not be called on a run that already failed")


def test_wandb_failure_is_survived(tmp_path, capsys):
    cfg = SimpleNamespace(wandb="off", wandb_project="p", wandb_entity=None, run_name=None)
    logger = MetricsLogger(cfg, str(tmp_path), rank=0, config_dict={})
    dead = logger.run = _DeadRun()
    scalars = {
        "loss": 1.0,
        "n_loops": 2,
        "gate_entropy": 0.5,
        "grad_norm": 1.0,
        "lr": 1e-3,
        "tokens_per_s": 10.0,
        "tflops": 0.0,
        "mfu": None,
    }
    per_loop = {"ce": [1.0, 0.9], "exit_prob": [0.5, 0.5], "hidden_rms": [1.0, 1.0]}
    logger.log(1, scalars, per_loop)
    logger.log(2, scalars, per_loop)
    logger.close()
    out = capsys.readouterr().out
    assert "warning: W&B log failed (BrokenPipeError" in out
    assert dead.calls == 1 and logger.run is None
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2  # both steps still recorded


def test_wandb_offline_panels_validation_section_config_and_commit(tmp_path, capsys):
    """A real offline W&B run: per-loop series and their loss-by-loop charts, validation under val/, the step
    breakdown under time/, the run config and the git commit in the W&B config."""
    import subprocess

    import wandb

    from titanloop.train.metrics import git_commit

    cfg = SimpleNamespace(wandb="offline", wandb_project="p", wandb_entity=None, run_name=None)
    logger = MetricsLogger(cfg, str(tmp_path), rank=0, config_dict={"training": {"steps": 3}}, trained_loops=2)
    assert logger.run is not None
    logged = []
    real_log = logger.run.log
    logger.run.log = lambda data, step: (logged.append((step, data)), real_log(data, step=step))[1]
    scalars = {
        "loss": 1.0,
        "n_loops": 2,
        "gate_entropy": 0.5,
        "grad_norm": 1.0,
        "lr": 1e-3,
        "tokens_per_s": 10.0,
        "tflops": 0.0,
        "mfu": None,
        "time/forward_s": 0.1,
    }
    val = {
        "val/loss/loop_1": 2.0,
        "val/loss/loop_2": 1.5,
        "val/loss/loop_4": 1.7,
        "val/ppl/loop_1": 7.4,
        "val/ppl/loop_2": 4.5,
        "val/ppl/loop_4": 5.5,
        "val/exit_depth": 1.6,
        "val/q_exit/q0.5/loss": 1.8,
        "val/q_exit/q0.5/avg_loops": 1.2,
        "val/tokens": 10,
        "val/seconds": 0.1,
    }
    for step in (1, 2, 3):
        per_loop = {"ce": [1.0 / step, 0.9 / step], "exit_prob": [0.5, 0.5], "hidden_rms": [1.0, 1.0]}
        logger.log(step, scalars, per_loop, val if step == 3 else None)
    config = dict(logger.run.config)
    logger.close()
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert config["git"]["commit"] == head == git_commit()["commit"] and len(head) == 40
    assert config["training"] == {"steps": 3}
    assert [s for s, _ in logged] == [1, 2, 3]
    first, last = logged[0][1], logged[2][1]
    assert {"ce/loop_1", "ce/loop_2", "exit_prob/loop_1", "time/forward_s", "loss"} <= set(first)
    assert "loss_by_loop/train_ce" in first and "loss_by_loop/val_loss" not in first
    assert {"val/loss/loop_4", "val/exit_depth", "loss_by_loop/train_ce", "loss_by_loop/val_loss"} <= set(last)
    chart = last["loss_by_loop/train_ce"]
    assert isinstance(chart, wandb.plot.custom_chart.CustomChart)
    assert chart.table.columns == ["step", "lineKey", "lineVal"]
    rows = chart.table.data  # one line per loop over steps 1..3
    assert sorted(rows) == sorted([[s, f"loop {t}", (1.0 if t == 1 else 0.9) / s] for s in (1, 2, 3) for t in (1, 2)])
    assert sorted({r[1] for r in last["loss_by_loop/val_loss"].table.data}) == ["T=1", "T=2", "T=4"]
    assert "warning" not in capsys.readouterr().out
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))


def test_validation_of_a_skipped_step_is_still_logged(tmp_path, capsys):
    """A non-finite (skipped) step has no training numbers to log; its validation numbers still get their line and
    their own metrics.jsonl record."""
    import json

    cfg = SimpleNamespace(wandb="off", wandb_project="p", wandb_entity=None, run_name=None)
    logger = MetricsLogger(cfg, str(tmp_path), rank=0, config_dict={}, trained_loops=1)
    val = {
        "val/loss/loop_1": 2.0,
        "val/ppl/loop_1": 7.39,
        "val/loss/loop_2": 1.9,
        "val/ppl/loop_2": 6.69,
        "val/exit_depth": 1.0,
        "val/q_exit/q0.5/loss": 2.0,
        "val/q_exit/q0.5/avg_loops": 1.0,
        "val/tokens": 8,
        "val/seconds": 0.1,
    }
    logger.log_validation(6, val)
    out = capsys.readouterr().out
    assert out.startswith("val      6 | loss/T 1:2.000 2:1.900 | ppl/T 1:7.39 2:6.69 | E[exit] 1.00 of 1")
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 6, **val}
