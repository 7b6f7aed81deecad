"""scripts/plan_vs_gpu.py without planning: it rebuilds the training arguments of every run the committed GPU
results measured, as the code that launched them did, and refuses a missing result in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from helpers import load_script

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "plan_vs_gpu.py"
pvg = load_script(SCRIPT, "plan_vs_gpu_script")


def _arg(args: list[str], key: str) -> str | None:
    """The value the trainer's parser keeps: the last one given."""
    at = [i for i, a in enumerate(args) if a == key]
    return args[at[-1] + 1] if at else None


def test_the_committed_runs_are_rebuilt_with_their_settings():
    check = json.loads((pvg.RESULTS / "gpu_check.json").read_text())
    runs = pvg.check_runs(check)
    measured = [r for r in check["result"]["runs"] if r.get("peak_gib")]
    assert len(runs) == len(measured) == 5
    for (label, args, n_gpus, peak), run in zip(runs, measured):
        assert peak == run["peak_gib"] and n_gpus == 1
        assert _arg(args, "--parallelism.activation_checkpoint") == run["ac"]
        assert _arg(args, "--loop_sampler.n_loops") == str(run["n_loops"])
        assert (_arg(args, "--parallelism.compile") == "true") == run["compiled"]
        assert (_arg(args, "--float8.recipe") or "off") == ("off" if run["precision"] == "bf16" else run["precision"])
    throughput = json.loads((pvg.RESULTS / "gpu_throughput.json").read_text())
    runs = {label: args for label, args, _, _ in pvg.throughput_runs(throughput)}
    # the matrix and the titanloop comparison runs with a peak; torchtitan's dense run is not titanloop's
    assert len(runs) == 5 and not any("torchtitan" in label for label in runs)
    looped = runs["gpu_throughput titanloop looped, 6 layers x T=4, 2 seq, no AC, bf16"]
    assert _arg(looped, "--model.n_layers") == "6" and _arg(looped, "--training.micro_batch_size") == "2"
    assert _arg(runs["gpu_throughput T=4 2 seq, AC loop, float8 tensorwise"], "--float8.recipe") == "tensorwise"
    selective = runs["gpu_throughput T=4 2 seq, AC selective, bf16"]
    assert _arg(selective, "--parallelism.activation_checkpoint") == "selective"
    # a second launch of the comparison (COMPARE_LAUNCHES) is the same run again: planned once
    first = next(r for r in throughput["result"]["runs"] if r["label"].startswith("titanloop looped"))
    again = {**first, "label": first["label"] + ", launch 2", "job": {**first["job"], "launch": 2}}
    throughput["result"]["runs"].append(again)
    assert [label for label, *_ in pvg.throughput_runs(throughput)] == list(runs)


def test_a_subset_at_other_loop_counts_is_rebuilt_too():
    """A session's gpu_check subset at T = 8 only (gpu_sessions/2026-11-28, call 3): both of its runs, at T = 8 (the
    default --loops 4 found none of them)."""
    subset = json.loads((pvg.RESULTS / "gpu_sessions" / "2026-11-28" / "call3_gpu_check.json").read_text())
    runs = pvg.check_runs(subset)
    assert [(label, _arg(args, "--loop_sampler.n_loops"), peak) for label, args, _, peak in runs] == [
        (f"gpu_check T=8 {r['precision']} AC loop", "8", r["peak_gib"]) for r in subset["result"]["runs"]
    ]


def test_a_missing_result_is_one_line_and_exit_2(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--check-json", str(tmp_path / "none.json")], capture_output=True, text=True
    )
    assert proc.returncode == 2 and proc.stderr.strip().startswith("error:") and len(proc.stderr.splitlines()) == 1
