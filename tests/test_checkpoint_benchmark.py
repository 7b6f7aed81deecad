"""Smoke test of benchmarks/checkpoint.py on a tiny model: it runs, prints the table and writes its JSON."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import checkpoint as bench  # noqa: E402


def test_checkpoint_benchmark_smoke(tmp_path, capsys):
    out = tmp_path / "ckpt.json"
    res = bench.main(["--hidden", "64", "--layers", "1", "--vocab", "512", "--repeats", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(res))
    for key in ("sync_save_s", "async_stall_s", "async_publish_s", "load_s"):
        assert res[key] > 0
    assert res["async_publish_s"] >= res["async_stall_s"]
    assert res["stall_ratio"] == res["async_stall_s"] / res["sync_save_s"]
    assert res["config"]["checkpoint_bytes"] > 3 * 4 * res["config"]["params"]  # weights + 2 AdamW moments
    assert "async stall / sync save" in capsys.readouterr().out
