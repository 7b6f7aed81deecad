"""The one-command benchmark runner works end to end at the tiniest sizes and writes its JSON."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_run_all_tiny_writes_every_row(tmp_path):
    proc = subprocess.run(
        [sys.executable, "benchmarks/run_all.py", "--tiny", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    combined = json.loads((tmp_path / "all.json").read_text())
    assert set(combined["results"]) == {
        "loop_efficiency",
        "loss_memory",
        "activation_checkpointing",
        "communication",
        "data_loader",
        "checkpoint",
        "scaling_on_paper",
        "document_masking",
    }
    eff = combined["results"]["loop_efficiency"]
    assert len(eff["rows"]) == 4 and {r["ce_backward"] for r in eff["rows"]} == {"fused", "recompute"}
    # T=4 loops of 2 layers with a readout per loop cost more FLOPs per token than 8 dense layers and one head
    assert eff["rows"][0]["flops_per_token"] > eff["rows"][1]["flops_per_token"], eff["rows"]
    comm = {r["layout"]: r["comms"] for r in combined["results"]["communication"]["rows"]}
    gather = [k for k in comm["fsdp2 looped (gather once)"] if "all_gather" in k]
    assert gather, comm
    # the looped stack gathered once per step issues fewer all-gathers than resharding after every use
    assert comm["fsdp2 looped (gather once)"][gather[0]] < comm["fsdp2 looped (reshard always)"][gather[0]]
    assert "ratio looplm/dense" in proc.stdout


def test_run_all_rejects_unknown_names():
    proc = subprocess.run(
        [sys.executable, "benchmarks/run_all.py", "--only", "nope"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "unknown benchmark(s) ['nope']" in proc.stderr
