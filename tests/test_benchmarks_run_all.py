"""The one-command benchmark runner works end to end at the tiniest sizes: every benchmark writes a report json
(benchmarks/report.py schema) with the commit it measured, and BENCHMARKS.md renders from them."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import run_all  # noqa: E402
from benchmarks.report import RESULTS, load_results, render  # noqa: E402


def _run_all(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "benchmarks/run_all.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def test_run_all_covers_every_committed_result():
    # one command regenerates every committed result: a json in benchmarks/results that run_all does not produce
    # could only have been written by hand (the GPU records in benchmarks/results/gpu/ are written on GPUs, each by
    # the command it records)
    committed = {p.stem for p in RESULTS.glob("*.json")}
    assert committed <= set(run_all.BENCHMARKS), committed - set(run_all.BENCHMARKS)


@pytest.mark.slow
def test_run_all_tiny_writes_every_report(tmp_path):
    # two at a time (numbers at --tiny mean nothing, so sharing the CPUs costs nothing but saves CI minutes)
    proc = _run_all("--tiny", "--jobs", "2", "--out", str(tmp_path), timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ours = set(run_all.BENCHMARKS) - run_all.NEEDS_NANOGPT  # no nanoGPT checkout here: left out, said so
    assert "left out nanogpt: it needs --nanogpt DIR" in proc.stdout
    assert {p.stem for p in tmp_path.glob("*.json")} == ours
    results = dict(load_results(tmp_path))  # validates every file against the schema (met vs target included)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    for name, script in ((n, s) for n, (s, _, _) in run_all.BENCHMARKS.items() if n in ours):
        data = results[name]
        assert data["commit"] == head, (name, data.get("commit"))
        # the recorded command regenerates this result file
        assert data["command"].startswith(f"python benchmarks/{script}.py"), (name, data["command"])
        assert data["command"].endswith(f"--out benchmarks/results/{name}.json"), (name, data["command"])
    text = render(list(results.items()))
    assert all(f'<a id="{name}"></a>' in text for name in ours)

    eff = results["loop_efficiency"]["result"]
    assert len(eff["rows"]) == 4 and {r["ce_backward"] for r in eff["rows"]} == {"fused", "recompute"}
    # T=4 loops of 2 layers with a readout per loop cost more FLOPs per token than 8 dense layers and one head
    assert eff["rows"][0]["flops_per_token"] > eff["rows"][1]["flops_per_token"], eff["rows"]
    # load-dependent figures: min <= median <= max over the repeats, and the summary reports the median
    s = eff["per_round_ratio"]["fused"]
    assert s["min"] <= s["median"] <= s["max"]
    assert results["loop_efficiency"]["summary"][0]["measured"] == round(s["median"], 3)
    ck = results["checkpoint"]["result"]
    assert len(ck["stall_ratio_per_repeat"]) == 2
    assert results["checkpoint"]["summary"][0]["measured"] == round(ck["stall_ratio_spread"]["median"], 3)
    comm = {r["layout"]: r["comms"] for r in results["communication"]["result"]["rows"]}
    # the looped stack gathered once per step issues fewer all-gathers than resharding after every use
    assert comm["fsdp2 looped (gather once)"]["all_gather"] < comm["fsdp2 looped (reshard always)"]["all_gather"]
    assert "wall time per benchmark" in proc.stdout and "2 at once" in proc.stdout
    # each benchmark's output is one block: its command line, its own output, its wall time; never another's lines
    marks = re.findall(r"^=== \[\d+/\d+\] (\w+): (python|\d+ s$)", proc.stdout, re.M)
    names = [name for name, kind in marks[::2]]
    assert sorted(names) == sorted(ours), marks
    assert [(n, k == "python") for n, k in marks] == [(n, first) for n in names for first in (True, False)], marks


def test_the_nanogpt_comparison_runs_from_the_checkout_given(tmp_path):
    """--nanogpt DIR must be a nanoGPT checkout (one line, exit 2, nothing run); the recorded result's command is
    the one run_all runs, the checkout left as a placeholder."""
    proc = _run_all("--only", "nanogpt", "--nanogpt", str(tmp_path))
    assert proc.returncode == 2 and "holds no train.py" in proc.stderr
    proc = _run_all("--only", "nanogpt", "--out", str(tmp_path))
    assert proc.returncode == 0 and "left out nanogpt" in proc.stdout and not list(tmp_path.glob("*.json"))
    recorded = json.loads((RESULTS / "nanogpt.json").read_text())["command"]
    assert (
        recorded.startswith("python benchmarks/nanogpt.py --nanogpt ")
        and "--out benchmarks/results/nanogpt.json" in recorded
    )


def test_run_all_rejects_unknown_names():
    proc = _run_all("--only", "nope")
    assert proc.returncode == 2 and "unknown benchmark(s) ['nope']" in proc.stderr


def test_run_all_runs_side_by_side_only_at_tiny_sizes():
    proc = _run_all("--jobs", "2", "--only", "scaling_on_paper")
    assert proc.returncode == 2 and "use it with --tiny only" in proc.stderr
    proc = _run_all("--tiny", "--jobs", "0")
    assert proc.returncode == 2 and "--jobs must be at least 1" in proc.stderr


def test_run_all_refuses_tiny_into_results():
    proc = _run_all("--tiny", "--results")
    assert proc.returncode == 2 and "--tiny writes meaningless numbers" in proc.stderr
