"""benchmarks/probes/loop_separation.py without training: its per-quarter summary, the record it makes of a finished
run's metrics.jsonl, and its usage errors (the training runs themselves are torchrun -m titanloop.train)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _probe():
    spec = importlib.util.spec_from_file_location("loop_separation", ROOT / "benchmarks/probes/loop_separation.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rows(n: int) -> list[dict]:
    # loop t's CE at step s: 10 - s + t, so each quarter's mean is known and the later loops are worse
    ends = {"hidden_rms": [1, 2, 3, 4], "exit_prob": [0.4, 0.3, 0.2, 0.1]}
    return [{"step": s, "ce": [10.0 - s + t for t in range(4)], **ends} for s in range(1, n + 1)]


def test_quarters_are_the_mean_of_each_quarter_per_loop():
    q = _probe().quarters(_rows(8), "ce")
    # steps 1-2, 3-4, 5-6, 7-8: mean step 1.5, 3.5, 5.5, 7.5
    assert q == [[8.5, 9.5, 10.5, 11.5], [6.5, 7.5, 8.5, 9.5], [4.5, 5.5, 6.5, 7.5], [2.5, 3.5, 4.5, 5.5]]


def test_a_finished_runs_metrics_are_recorded_and_merged(tmp_path, monkeypatch):
    probe = _probe()
    metrics = tmp_path / "metrics.jsonl"
    # a validation-only row (no "ce") is skipped
    metrics.write_text("\n".join(json.dumps(r) for r in [*_rows(8), {"step": 8, "val/ce": 1.0}]) + "\n")
    first, merged = tmp_path / "a.json", tmp_path / "b.json"
    argv = ["x", "--out", str(first), "--seeds=", "--from-metrics", f"all_four:5:{metrics}", "--note", "n"]
    monkeypatch.setattr(sys, "argv", argv)
    probe.main()
    doc = json.loads(first.read_text())
    (run,) = doc["runs"]
    assert (run["variant"], run["seed"], run["steps_logged"]) == ("all_four", 5, 8)
    assert run["args"] == probe.VARIANTS["all_four"]
    assert run["ce_per_loop_by_quarter"][-1] == [2.5, 3.5, 4.5, 5.5] and doc["notes"] == ["n"]
    assert run["exit_prob_end"] == [0.4, 0.3, 0.2, 0.1]
    monkeypatch.setattr(sys, "argv", ["x", "--out", str(merged), "--seeds=", "--merge", str(first)])
    probe.main()
    (again,) = json.loads(merged.read_text())["runs"]
    # a merged run keeps where it came from (here the metrics file) and gains the commit of the json it came from
    assert again["from"] == f"metrics {metrics}" and again["commit"] == doc["commit"]
    assert again["ce_per_loop_by_quarter"] == run["ce_per_loop_by_quarter"]


@pytest.mark.parametrize(
    "args, says",
    [
        (["--variants", "all_five"], "unknown variant(s) ['all_five']"),
        (["--seeds=", "--from-metrics", "bogus:1:x.jsonl"], "give VARIANT:SEED:PATH"),
        (["--seeds=", "--from-metrics", "all_four"], "give VARIANT:SEED:PATH"),
        (["--seeds=", "--from-metrics", "all_four:x:metrics.jsonl"], "an integer seed"),
        (["--seeds=", "--from-metrics", "all_four:1:missing.jsonl"], "an existing metrics.jsonl"),
        (["--seeds=", "--merge", "missing.json"], "--merge missing.json: no such file"),
    ],
)
def test_usage_errors_say_what_is_wrong(tmp_path, monkeypatch, capsys, args, says):
    monkeypatch.setattr(sys, "argv", ["x", "--out", str(tmp_path / "o.json"), *args])
    with pytest.raises(SystemExit) as e:
        _probe().main()
    assert e.value.code == 2 and says in capsys.readouterr().err
    assert not (tmp_path / "o.json").exists()
