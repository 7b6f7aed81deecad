"""Smoke test of benchmarks/checkpoint.py on a tiny model: it runs, prints the table and writes its JSON."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import checkpoint as bench  # noqa: E402


def test_checkpoint_benchmark_smoke(tmp_path, capsys):
    out = tmp_path / "ckpt.json"
    res = bench.main(["--hidden", "64", "--layers", "1", "--vocab", "512", "--repeats", "2", "--out", str(out)])
    report = json.loads(out.read_text())  # the BENCHMARKS.md schema, the raw figures under "result"
    assert report["result"] == json.loads(json.dumps(res)) and report["commit"] and report["summary"]
    # every timed save and load is recorded, and each reported figure is the median of its own samples
    for key in ("sync_save_s", "async_stall_s", "async_publish_s", "load_s"):
        assert len(res["raw"][key]) == 2 and min(res["raw"][key]) <= res[key] <= max(res["raw"][key])
    # an async save is published only after its stall ended, save by save
    assert all(p >= s for p, s in zip(res["raw"]["async_publish_s"], res["raw"]["async_stall_s"]))
    # the async save holds the weights of its save call although training steps changed them during the write
    assert min(res["train_steps_during_async_write"]) >= 1 and res["async_checkpoint_holds_save_state"]
    # what is saved is weights + 2 AdamW moments in fp32 (+ RNG states and metadata), nothing more or less
    n_bytes, params = res["config"]["checkpoint_bytes"], res["config"]["params"]
    assert 3 * 4 * params < n_bytes < 3.5 * 4 * params, (n_bytes, params)
    assert "async stall / sync save" in capsys.readouterr().out
