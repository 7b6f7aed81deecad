"""Non-finite gradient norms (issue 14), through torchrun -m titanloop.train with 2 ranks (gloo):

- on_nonfinite='skip' (default), bf16 parameters with fp32 gradient reduction (FSDP2 MixedPrecisionPolicy):
  a NaN put into one gradient on the last rank at step 3 (the loss stays finite) makes the all-reduced norm
  NaN; every rank skips the step with a message, records it in <run_dir>/nonfinite/, training continues;
- on_nonfinite='stop': the first one stops every rank with a one-line error and exit code 3.
"""

from __future__ import annotations

import json
import math
import re

import pytest

from launch import SMALL_BATCH, train

pytestmark = pytest.mark.slow
COMMON = {**SMALL_BATCH, "training.steps": 5, "metrics.log_freq": 1, "lr_scheduler.warmup_steps": 1}


@pytest.fixture(scope="module")
def skip_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("nonfinite") / "skip"
    overrides = {**COMMON, "training.inject_nan_grad_steps": [3], "training.dtype": "bfloat16"}
    return run_dir, train(run_dir, overrides, check=False)


@pytest.fixture(scope="module")
def stop_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("nonfinite") / "stop"
    overrides = {**COMMON, "training.inject_nan_grad_steps": [2], "training.on_nonfinite": "stop"}
    return run_dir, train(run_dir, overrides, check=False)


def test_nonfinite_grad_norm_is_skipped_and_recorded(skip_run):
    run_dir, proc = skip_run
    out = proc.out
    assert proc.returncode == 0, out[-3000:]
    assert "step     3 | non-finite gradient norm (nan): step skipped (1 in a row, limit 3)" in out
    m = proc.by_step
    assert 3 not in m and m[5]["skipped_steps"] == 1  # a skipped step is not logged; training went on
    assert all(math.isfinite(m[s]["loss"]) for s in (1, 2, 4, 5))
    records = [json.loads(p.read_text()) for p in sorted((run_dir / "nonfinite").glob("step-3.rank-*.json"))]
    assert len(records) == 2 and all(r["step"] == 3 and math.isnan(r["nonfinite_grad_norm"]) for r in records)
    assert records[0]["nonfinite_grads"] == [] and records[1]["nonfinite_grads"]  # only the last rank's grad
    assert "bfloat16 params" in out  # the bf16 + fp32-reduce policy was in effect


def test_nonfinite_grad_norm_stops_when_configured(stop_run):
    run_dir, proc = stop_run
    out = proc.out
    # A worker exits 3; torchrun then tears its peer down with SIGTERM if it has not exited yet (a race), so
    # every reported failure is exit 3 or that SIGTERM. Both ranks reaching the stop is shown by their records.
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", out)
    assert proc.returncode != 0 and "3" in codes and set(codes) <= {"3", "-15"}, out[-3000:]
    assert (
        "error: stopped at step 2 after 1 non-finite steps (loss or gradient norm) in a row "
        "(training.on_nonfinite='stop')"
    ) in out
    assert sorted(p.name for p in (run_dir / "nonfinite").iterdir()) == ["step-2.rank-0.json", "step-2.rank-1.json"]
