"""scripts/ac_kept_loops.py: the largest parallelism.ac_kept_loops whose memory plan fits, found by bisection over
real dry-run plans (train_configs/debug.toml at world size 2: a few seconds per plan)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import load_script

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "ac_kept_loops.py"
akl = load_script(SCRIPT, "ac_kept_loops_script")
CONFIG = "train_configs/debug.toml"
LOOP_AC = ["--parallelism.activation_checkpoint", "loop"]
NO_AC = ["--parallelism.activation_checkpoint", "none"]


@pytest.mark.parametrize("n_loops", [1, 4, 8])
def test_bisection_finds_the_largest_fitting_k_with_few_plans(n_loops):
    for limit in range(-1, n_loops + 1):  # fits(k) iff k <= limit (-1: nothing fits)
        tried = []

        def fits(k):
            tried.append(k)
            return k <= limit

        best, seen = akl.largest_fitting(n_loops, fits)
        assert best == (limit if limit >= 0 else None)
        assert len(tried) == len(set(tried)) == len(seen) <= (n_loops + 2).bit_length()


def test_keeping_every_loop_is_no_activation_checkpointing():
    assert akl.kept_overrides(2, 4) == [
        "--parallelism.activation_checkpoint",
        "loop",
        "--parallelism.ac_kept_loops",
        "2",
    ]
    assert akl.kept_overrides(4, 4) == [
        "--parallelism.activation_checkpoint",
        "none",
        "--parallelism.ac_kept_loops",
        "0",
    ]


def _run(tmp_path, *args):
    out = tmp_path / "plans.json"
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--config", CONFIG, "--world-size", "2", *LOOP_AC, *args, "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return r, (json.loads(out.read_text()) if out.exists() else None)


def test_the_script_reports_the_largest_k_whose_real_plan_fits(tmp_path):
    # every k's plan, the script's way (0 GB reserve: the debug model's plans are a few MB)
    everything, doc = _run(tmp_path, "--gpu-mem-gb", "1000", "--reserve-gb", "0")
    assert everything.returncode == 0, everything.stderr
    assert "every loop fits" in everything.stdout and doc["largest"] == doc["n_loops"] == 4
    peaks = {}
    for k in range(5):  # the plans the bisection did not need
        peaks[k] = akl.dry_run(
            akl.load_config(CONFIG, [*LOOP_AC, *akl.kept_overrides(k, 4)], world_size=2), 2, memory_plan=True
        ).memory_plan.peak
    assert all(peaks[k] < peaks[k + 1] for k in range(4)), peaks  # each kept loop holds more: the bisection's premise
    limit_gb = (peaks[2] + peaks[3]) / 2 / 1e9  # k = 2 fits, k = 3 does not
    selective = akl.dry_run(
        akl.load_config(CONFIG, ["--parallelism.activation_checkpoint", "selective"], world_size=2), 2, memory_plan=True
    ).memory_plan.peak
    r, doc = _run(tmp_path, "--gpu-mem-gb", repr(limit_gb), "--reserve-gb", "0", "--selective")
    assert r.returncode == 0, r.stderr
    # --selective: one more plan, of selective AC, read from the same config and overrides
    assert doc["selective"] == {
        "peak_bytes": selective,
        "peak_gb": round(selective / 1e9, 2),
        "fits": selective <= limit_gb * 1e9,
    }
    assert f"selective AC {'fits' if doc['selective']['fits'] else 'does not fit'} (" in r.stdout
    assert "largest that fits: --parallelism.ac_kept_loops 2" in r.stdout
    assert "recomputes 2 of 4 loops" in r.stdout
    assert doc["largest"] == 2 and {p["kept_loops"]: p["peak_bytes"] for p in doc["plans"]} == {
        2: peaks[2],
        3: peaks[3],
    }
    fit = doc["selective"]["fits"]  # one line per plan, as it runs
    assert r.stdout.count("does NOT fit") == 1 + (not fit) and r.stdout.count(" fits in ") == 1 + fit
    # a margin of the planned peak kept free: the same limit now leaves k = 2 out, from a config without AC
    margin = (limit_gb * 1e9 / peaks[2] - 1) * 1.01
    r, doc = _run(tmp_path, "--gpu-mem-gb", repr(limit_gb), "--reserve-gb", "0", "--margin", repr(margin), *NO_AC)
    assert r.returncode == 0, r.stderr
    assert "(now: AC none)" in r.stdout and doc["largest"] == 1 and doc["margin"] == margin


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    r, _ = _run(tmp_path, "--margin", "1.5")
    assert r.returncode == 2 and r.stderr == "error: --margin=1.5 is invalid: expected a fraction in [0, 1), e.g. 0.1\n"
    r, _ = _run(tmp_path, "--parallelism.ac_kept_loops", "-1")  # the config's own check, before any plan
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "ac_kept_loops=-1" in r.stderr
    r, doc = _run(tmp_path, "--gpu-mem-gb", "1")  # the 4 GB reserve alone does not fit
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "not even per-loop AC" in r.stderr
    assert doc["largest"] is None and [p["kept_loops"] for p in doc["plans"]] == [0, 2]
