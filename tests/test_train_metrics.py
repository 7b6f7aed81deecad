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
    scalars = {"loss": 1.0, "n_loops": 2, "gate_entropy": 0.5, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_s": 10.0,
               "tflops": 0.0, "mfu": None}
    per_loop = {"ce": [1.0, 0.9], "exit_prob": [0.5, 0.5], "hidden_rms": [1.0, 1.0]}
    logger.log(1, scalars, per_loop)
    logger.log(2, scalars, per_loop)
    logger.close()
    out = capsys.readouterr().out
    assert "warning: W&B log failed (BrokenPipeError" in out
    assert dead.calls == 1 and logger.run is None
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2  # both steps still recorded
