"""Test-only launcher: `torchrun ... tests/slowed_rank_driver.py --config C [--section.key value ...]` runs the real
trainer (titanloop.train.__main__.main, same arguments) with one extra callback that slows rank $SLOW_RANK by
$SLOW_SECONDS in every loop of every forward (a pre-hook on the final norm, which runs after FSDP's all-gathers of
the first loop). Used by tests/test_train_step_timer.py to check that the step-time breakdown names a slow rank;
nothing on the production path reads these variables."""

from __future__ import annotations

import os
import sys
import time

import titanloop.train.callbacks as callbacks
import titanloop.train.run_callbacks as run_callbacks
from titanloop.train.__main__ import main
from titanloop.train.process_exit import exit_without_teardown


class SlowRank(callbacks.Callback):
    def pre_train(self, run) -> None:
        if run.mesh.rank == int(os.environ["SLOW_RANK"]):
            seconds = float(os.environ["SLOW_SECONDS"])
            run.engine.model.norm.register_forward_pre_hook(lambda *args: time.sleep(seconds))


_default_callbacks = run_callbacks.default_callbacks
run_callbacks.default_callbacks = lambda run: [SlowRank(), *_default_callbacks(run)]

if __name__ == "__main__":
    exit_without_teardown(main(sys.argv[1:]))
