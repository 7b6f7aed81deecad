"""BENCHMARKS.md is generated from benchmarks/results/*.json and must be up to date with it."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _report(*args):
    return subprocess.run([sys.executable, "-m", "benchmarks.report", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


def test_benchmarks_md_matches_committed_results():
    proc = _report("--check")
    assert proc.returncode == 0, proc.stderr


def _write(tmp_path, **over):
    res = tmp_path / "results"
    res.mkdir(exist_ok=True)
    data = {"title": "T", "command": "python benchmarks/x.py", "date": "2026-11-23", "machine": "cpu",
            "summary": [{"row": "ratio", "measured": 0.3, "target": "<= 0.25", "met": False}],
            "tables": [{"columns": ["a", "b"], "rows": [[1, 2.5]]}], **over}
    (res / "x.json").write_text(json.dumps(data))
    return res


def test_generator_detects_stale_markdown(tmp_path):
    res = _write(tmp_path)
    out = tmp_path / "B.md"
    assert _report("--results", str(res), "--out", str(out)).returncode == 0
    text = out.read_text()
    assert "| ratio ([x](#x)) | 0.3 | <= 0.25 | no |" in text and "| 1 | 2.5 |" in text
    out.write_text(text.replace("0.3", "0.2"))  # someone edited a number by hand
    proc = _report("--results", str(res), "--out", str(out), "--check")
    assert proc.returncode == 1 and "out of date" in proc.stderr


def test_generator_refuses_met_that_contradicts_the_numbers(tmp_path):
    res = _write(tmp_path, summary=[{"row": "stall", "measured": 0.484, "target": "<= 0.25", "met": True}])
    proc = _report("--results", str(res), "--out", str(tmp_path / "B.md"))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: benchmark result x.json: summary[0] ('stall') says met=True but measured 0.484 vs target "
        "'<= 0.25' gives False"]


def test_generator_refuses_ragged_tables(tmp_path):
    res = _write(tmp_path, tables=[{"columns": ["a", "b"], "rows": [[1]]}])
    proc = _report("--results", str(res), "--out", str(tmp_path / "B.md"))
    assert proc.returncode == 2 and "tables[0] row 0 does not have 2 cells" in proc.stderr
