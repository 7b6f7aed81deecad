"""Test-only launcher: `torchrun ... tests/step_cost_driver.py --config C [--section.key value ...]` runs the real
trainer (titanloop.train.__main__.main, same arguments) and records, per rank, at which steps the objective
computed its per-loop statistics (titanloop.objectives.objective.loop_statistics) and which statistics each step
all-reduced (titanloop.train.loop.mean_over_ranks), in <run_dir>/step_cost.rank{R}.json after every step. Used
by tests/test_train_step_cost.py; nothing on the production path reads it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import titanloop.objectives.objective as objective
import titanloop.train.callbacks as callbacks
import titanloop.train.loop as loop
import titanloop.train.run_callbacks as run_callbacks
from titanloop.train.__main__ import main
from titanloop.train.process_exit import exit_without_teardown

SEEN = {"step": 0, "statistics": [], "reduced": {}}

_loop_statistics = objective.loop_statistics
_train_step = loop.train_step
_mean_over_ranks = loop.mean_over_ranks


def loop_statistics(*args, **kwargs):
    SEEN["statistics"].append(SEEN["step"])
    return _loop_statistics(*args, **kwargs)


def train_step(run, *args, **kwargs):
    SEEN["step"] = run.state.step
    return _train_step(run, *args, **kwargs)


def mean_over_ranks(loss_sum, stats_sum, *args, **kwargs):
    SEEN["reduced"][SEEN["step"]] = sorted(stats_sum)
    return _mean_over_ranks(loss_sum, stats_sum, *args, **kwargs)


class Record(callbacks.Callback):
    def post_step(self, run, result) -> None:
        path = Path(run.cfg.training.run_dir) / f"step_cost.rank{run.mesh.rank}.json"
        path.write_text(json.dumps(SEEN))


objective.loop_statistics = loop_statistics
loop.train_step = train_step
loop.mean_over_ranks = mean_over_ranks
_default_callbacks = run_callbacks.default_callbacks
run_callbacks.default_callbacks = lambda run: [*_default_callbacks(run), Record()]

if __name__ == "__main__":
    exit_without_teardown(main(sys.argv[1:]))
