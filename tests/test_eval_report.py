"""titanloop.eval report: schema, PNG plots, CLI end to end on an exported HF checkpoint, bad input."""

import json
import os
import struct
import subprocess
import sys

import pytest
import torch

from titanloop.config_errors import ConfigError
from titanloop.eval.__main__ import main
from titanloop.eval import EvalConfig, evaluate, load_model, validate_report, write_report
from titanloop.interchange import export_ouro_hf
from titanloop.model import LoopLM, preset

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def tiny_model() -> LoopLM:
    return LoopLM(preset("debug-tiny", vocab_size=64, n_layers=1, n_loops=2)).eval()


def seqs(n=6, length=14):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 64, (length,), generator=g).tolist() for _ in range(n)]


def check_png(path):
    data = open(path, "rb").read()
    assert data[:8] == PNG_SIGNATURE
    width, height = struct.unpack(">II", data[16:24])  # IHDR
    assert width >= 300 and height >= 200 and len(data) > 5000


@pytest.fixture(scope="module")
def report():
    torch.manual_seed(0)
    return evaluate(tiny_model(), seqs(), EvalConfig(jsrr_power_steps=2, batch_size=4))


def test_report_schema(report):
    validate_report(report)
    assert report["depth_sweep"]["loops"] == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]  # default: log-spaced to 64
    assert report["data"] == {"batches": 2, "examples": 6, "scored_tokens": 6 * 13}
    fr = report["exit_frontier"]
    assert {p["strategy"] for p in fr["points"]} == {"static", "q_exit", "hidden_diff", "logit_margin", "ash"}
    assert all(1.0 <= p["avg_loops"] <= 64.0 and sum(p["exit_histogram"]) == 78 for p in fr["points"])
    # the frontier reaches past the trained depth (2): every loop up to the deepest swept one is a static point
    assert fr["exit_loops"] == 64
    assert sorted(p["param"]["t"] for p in fr["points"] if p["strategy"] == "static") == list(range(1, 65))
    d = report["diagnostics"]
    assert [r["loop"] for r in d["hidden_rms"]] == list(range(1, 65))
    assert all(r["mean"] <= r["p99"] <= r["max"] for r in d["hidden_rms"])
    assert sum(d["exit_distribution"]["p_mean"]) == pytest.approx(1.0, abs=1e-5)
    assert [r["loop"] for r in d["spectral_radius"]] == [1, 2, 4]
    broken = dict(report, depth_sweep={"points": [{"loops": 1}]})
    with pytest.raises(ConfigError, match="depth_sweep"):
        validate_report(broken)


def test_write_report_json_and_pngs(report, tmp_path):
    paths = write_report(report, tmp_path / "out")
    assert set(paths) == {"report", "depth_curve", "pareto", "hidden_norms"}
    for key in ("depth_curve", "pareto", "hidden_norms"):
        check_png(paths[key])
    back = json.loads(open(paths["report"]).read())
    validate_report(back)
    assert back["depth_sweep"]["points"][0]["loss"] == pytest.approx(report["depth_sweep"]["points"][0]["loss"])
    assert not list((tmp_path / "out").glob("*.tmp"))


def test_write_report_refuses_file_as_dir(report, tmp_path):
    f = tmp_path / "file"
    f.write_text("keep me")
    with pytest.raises(ConfigError, match="is a file"):
        write_report(report, f)
    assert f.read_text() == "keep me"


def test_load_model_formats(tmp_path):
    m = tiny_model()
    export_ouro_hf(m, tmp_path / "hf")
    loaded = load_model(tmp_path / "hf")
    ids = torch.randint(0, 64, (1, 5))
    torch.testing.assert_close(loaded(ids, return_logits="last").logits, m(ids, return_logits="last").logits)
    (tmp_path / "notmodel").mkdir()
    (tmp_path / "notmodel" / "weights.bin").write_bytes(b"x")
    with pytest.raises(ConfigError, match="not a LoopLM checkpoint"):
        load_model(tmp_path / "notmodel")
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ConfigError, match="model_type='llama' is invalid"):
        load_model(tmp_path / "llama")


def test_load_model_from_dcp_checkpoint(tmp_path):
    from titanloop.checkpoint import CheckpointConfig, Checkpointer

    m = LoopLM(preset("debug-tiny", vocab_size=64, n_layers=1, tie_embeddings=True)).eval()
    model_section = {"preset": "debug-tiny", "vocab_size": 64, "n_layers": 1, "tie_embeddings": True}
    ck = Checkpointer(CheckpointConfig(mode="sync"), tmp_path / "run", {"model": m}, config={"model": model_section})
    ck.save(7, sync=True)
    ck.close()
    ids = torch.randint(0, 64, (2, 5))
    for path in (tmp_path / "run" / "checkpoints", tmp_path / "run" / "checkpoints" / "step-00000007"):
        loaded = load_model(path)
        assert torch.equal(loaded(ids, return_logits="last").logits, m(ids, return_logits="last").logits)
    bare = Checkpointer(CheckpointConfig(mode="sync"), tmp_path / "bare", {"model": m})
    bare.save(1, sync=True)
    bare.close()
    with pytest.raises(ConfigError, match="has no model config"):
        load_model(tmp_path / "bare" / "checkpoints")
    (tmp_path / "bare" / "checkpoints" / "step-00000001" / "titanloop.json").unlink()
    with pytest.raises(ConfigError, match="DCP checkpoint without titanloop.json"):
        load_model(tmp_path / "bare" / "checkpoints" / "step-00000001")


def run_cli(*args, cwd=None):
    env = dict(os.environ, OMP_NUM_THREADS="1", MPLBACKEND="Agg")
    return subprocess.run(
        [sys.executable, "-m", "titanloop.eval", *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=300
    )


@pytest.mark.slow
def test_cli_sweep_end_to_end(tmp_path):
    export_ouro_hf(tiny_model(), tmp_path / "hf")
    data = tmp_path / "seqs.jsonl"
    data.write_text("\n".join(json.dumps(s) for s in seqs(4)))
    r = run_cli(
        "sweep",
        str(tmp_path / "hf"),
        "--data",
        str(data),
        "--out",
        str(tmp_path / "ev"),
        "--loops",
        "1,2,3",
        "--q",
        "0,0.5,1",
        "--jsrr-loops",
        "2",
    )
    assert r.returncode == 0, r.stderr
    assert "Pareto frontier" in r.stdout and "pareto.png" in r.stdout
    rep = json.loads((tmp_path / "ev" / "report.json").read_text())
    assert [p["loops"] for p in rep["depth_sweep"]["points"]] == [1, 2, 3]
    check_png(tmp_path / "ev" / "pareto.png")


def test_cli_generate_prints_cache_accounting(tmp_path, capsys):
    export_ouro_hf(tiny_model(), tmp_path / "hf")
    main(["generate", str(tmp_path / "hf"), "--prompt-ids", "1,2,3", "--max-new-tokens", "4", "--cache-policy", "last"])
    out = json.loads(capsys.readouterr().out)
    assert len(out["new_tokens"]) == 4 and out["memory_reduction"] == 2.0  # T = 2


def test_cli_bad_input_one_line_errors(tmp_path):
    export_ouro_hf(tiny_model(), tmp_path / "hf")
    data = tmp_path / "seqs.jsonl"
    data.write_text("\n".join(json.dumps(s) for s in seqs(2)))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    cases = [
        (["sweep", str(data), "--data", str(data)], "is not a LoopLM checkpoint"),
        (["sweep", str(tmp_path / "hf"), "--data", str(data), "--loops", "0,2"], "loops=0 is invalid"),
        (["sweep", str(tmp_path / "hf"), "--data", str(data), "--q", "0.5,2"], "q_thresholds=2.0 is invalid"),
        (["sweep", str(tmp_path / "hf"), "--data", str(empty)], "dataset is empty"),
        (["generate", str(tmp_path / "hf"), "--prompt-ids", "1", "--cache-policy", "middle"], "cache_policy"),
    ]
    for args, msg in cases:
        with pytest.raises(SystemExit) as e:
            main([*args, "--out", str(tmp_path / "x")] if args[0] == "sweep" else args)
        text = str(e.value.code)
        assert text.startswith("error: ") and msg in text and "\n" not in text, text
    assert not (tmp_path / "x").exists()
