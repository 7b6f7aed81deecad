"""Smoke tests of the benchmark scripts at tiny sizes (the real runs are in the scripts' docstrings)."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import PeakMemory, time_repeated  # noqa: E402
from benchmarks import loss_memory  # noqa: E402
from benchmarks.report import validate  # noqa: E402


def test_peak_memory_tracks_cpu_tensors():
    def work():
        a = torch.empty(1024, 1024)  # 4 MiB
        b = torch.empty(2048, 1024)  # 8 MiB, both alive: peak 12 MiB
        del a
        c = torch.empty(1024, 1024)  # 4 MiB after a is freed: still 12 MiB
        return b, c

    with PeakMemory() as mem:
        work()
    assert mem.peak_bytes == 12 * 1024 * 1024
    lin = torch.nn.Linear(256, 256, bias=False)  # 256 KiB of parameters, created outside the block
    with PeakMemory(lin) as mem:
        pass
    assert mem.peak_bytes == 256 * 256 * 4 and mem.peak_by_kind["Parameter"] == 256 * 256 * 4


def test_time_repeated_alternates_and_summarizes():
    calls = []
    res = time_repeated({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, warmup=1, repeats=3)
    assert calls == ["a", "b"] + ["a", "b"] * 3
    for r in res.values():
        assert r["repeats"] == 3 and r["min"] <= r["median"] <= r["max"] and len(r["times"]) == 3


def test_loss_memory_smoke(tmp_path, capsys):
    out = tmp_path / "loss_memory.json"
    loss_memory.main(
        ["--vocab", "8192", "--hidden", "32", "--layers", "1", "--seq-len", "64", "--batch", "2", "--out", str(out)]
    )
    report = json.loads(out.read_text())  # the report json (benchmarks/report.py schema), raw figures in "result"
    validate(out, report)
    assert report["commit"] and report["summary"][0]["target"] == "<= 1.15"
    res = report["result"]
    assert {r["variant"] for r in res["rows"]} == set(loss_memory.VARIANTS)
    assert res["config"]["vocab"] == 8192 and res["config"]["loops"] == 4
    assert res["per_loop_matches_naive"]
    by = {r["variant"]: r["peak_bytes"] for r in res["rows"]}
    assert all(v > 0 for v in by.values())
    # the logits dominate at this size: per-loop must stay near final-only, the naive version must not
    assert res["ratios"]["per_loop/final_only"] <= 1.15
    assert res["ratios"]["per_loop_naive/per_loop"] > 1.5
    # the fused readout (the default) matches the naive Stage I and holds no more than the recompute path
    assert res["per_loop_fused_matches_naive"]
    assert res["ratios"]["per_loop_fused/final_only_fused"] <= 1.15
    assert res["ratios"]["per_loop_fused/per_loop"] <= 1.0
    assert "per_loop/final_only" in capsys.readouterr().out


# The benchmarks without a test of their own, at their smallest sizes (numbers meaningless): each writes a valid
# record naming the command that measured it (without --out), its date, commit and torch.
TINY = {
    "activation_checkpointing": ["loss_memory", "--ac", "--loops", "1", "2", "--hidden", "64", "--vocab", "512"]
    + ["--seq-len", "32", "--batch", "2", "--repeats", "2"],
    "checkpoint_verify": ["checkpoint", "--verify", "--hidden", "64", "--layers", "1", "--repeats", "2"],
    "network_per_step": ["memory_plan", "--network"],
    "memory_plan": ["memory_plan", "--quick", "--stages", ""],
    "data_locality": ["data_loader", "--locality", "--seq-len", "256"],
}


@pytest.mark.slow
@pytest.mark.parametrize("what", TINY)
def test_each_benchmark_writes_a_record_at_tiny_sizes(tmp_path, what):
    import shlex
    import subprocess

    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "record.json"
    script, *args = TINY[what]
    cmd = [sys.executable, f"benchmarks/{script}.py", *args, "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    record = validate(out, json.loads(out.read_text()))
    assert record["command"] == shlex.join(["python", f"benchmarks/{script}.py", *args])
    assert len(record["commit"]) == 40 and record["torch"] == torch.__version__ and record["date"][:2] == "20"
