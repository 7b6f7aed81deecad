"""benchmarks/gpu_throughput.py --vs-dense and its torchtitan harness (benchmarks/torchtitan_dense.py) without a GPU:
the dense model's layer count at equal FLOPs per token, torchtitan's logged numbers read back, the baseline falling back
to titanloop's own dense model when torchtitan fails, the harness's pieces, and (slow) the --smoke run on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_throughput as lvd
from benchmarks import torchtitan_dense as td
from benchmarks.report import validate
from titanloop.model.config import preset

ROOT = Path(__file__).resolve().parent.parent


def test_dense_layers_match_the_looped_models_flops_per_token():
    looped = preset("ouro-1.4b", n_layers=6)
    lengths = lvd.synthetic_doc_lengths(4096, 49152, rows=4)
    target = looped.flops_per_token(4096, n_loops=4, doc_lengths=lengths)

    def off(n):
        return abs(looped.replace(n_layers=n, n_loops=1).flops_per_token(4096, n_loops=1, doc_lengths=lengths) - target)

    n = lvd.dense_layers_for(looped, 4096, 4, lengths)
    assert off(n) <= min(off(n - 1), off(n + 1)) and off(n) / target < 0.02, n
    assert n > 24  # the per-loop readouts cost the looped model more than a dense one's single LM head


def test_dense_throughput_reads_torchtitans_metrics():
    rows = [{"step": s, "throughput(tps)": t, "mfu(%)": 40.0, "memory/max_active(GiB)": m}
            for s, t, m in ((1, 10.0, 50.0), (2, 8000.0, 50.0), (3, 8200.0, 49.0), (4, 8400.0, 0.0))]  # fmt: skip
    d = lvd.dense_throughput(rows, warmup=1)
    assert d == {"tokens_per_s_gpu": 8200.0, "peak_gib": 50.0, "torchtitan_mfu": 0.4}
    with pytest.raises(ValueError, match="no logged step after the warm-up"):
        lvd.dense_throughput(rows[:1], warmup=1)


def test_a_failed_torchtitan_run_falls_back_to_titanloops_dense_model(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(lvd, "run_titanloop", lambda a, w, name, layers, t: calls.append((name, layers, t)) or {
        "status": "ok", "tokens_per_s_gpu": 1000.0 * t, "peak_gib": None})  # fmt: skip
    monkeypatch.setattr(lvd, "run_torchtitan", lambda a, w, name, layers: {"status": "failed", "reason": "exit 1: x"})
    out = tmp_path / "lvd.json"
    assert lvd.main(["--vs-dense", "--smoke", "--launches", "2", "--out", str(out)]) == 0
    doc = validate(out, json.loads(out.read_text()))
    assert [c[0] for c in calls] == ["looped-1", "titanloop-dense-1", "looped-2", "titanloop-dense-2"]
    assert doc["summary"][0]["measured"] == 4.0 and doc["summary"][0]["met"]  # T = 4 against T = 1, per the fake
    assert [r[0].split(",")[0] for r in doc["tables"][0]["rows"][:3]] == [
        "titanloop looped", "torchtitan dense llama3", "titanloop dense"]  # fmt: skip


# ----- the torchtitan harness ----------------------------------------------------------------------------------
def test_document_positions_restart_at_every_document():
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 2], [5, 5, 5, 5, 5, 5]])
    assert td.document_positions(doc_ids).tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]]


def test_import_stand_ins_only_for_missing_modules(monkeypatch):
    monkeypatch.setattr(td, "STAND_INS", {"json": ("loads",), "no_such_pkg_xyz": ("Thing", "load")})
    monkeypatch.delitem(sys.modules, "no_such_pkg_xyz", raising=False)
    try:
        assert td.install_import_stand_ins() == ["no_such_pkg_xyz"]
        from no_such_pkg_xyz import Thing, load  # noqa: PLC0415 - the stand-in, as torchtitan imports it

        with pytest.raises(ImportError, match="stand-in"):
            Thing()
        with pytest.raises(ImportError, match="stand-in"):
            load("x")
        assert json.loads("[1]") == [1]  # an installed module is left alone
    finally:
        sys.modules.pop("no_such_pkg_xyz", None)


def test_torch_compat_lets_torchtitan_pass_separate_full_blocks_to_an_older_torch(monkeypatch):
    """The first H100 run's dense baseline failed: torchtitan 0.3.0 passes `separate_full_blocks=True` to
    create_block_mask, which torch 2.11 does not accept (it always separates full blocks). Here the current
    torch's function stands in for 2.11's, stripped of the keyword; the compat must wrap it, build the same mask
    with True, and refuse False."""
    import torch.nn.attention.flex_attention as flex  # noqa: PLC0415

    real = flex.create_block_mask

    def older_create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device=None, BLOCK_SIZE=128):
        return real(mask_mod, B, H, Q_LEN, KV_LEN, device=device, BLOCK_SIZE=BLOCK_SIZE)

    monkeypatch.setattr(flex, "create_block_mask", older_create_block_mask)
    added = td.install_torch_compat()
    assert "create_block_mask(separate_full_blocks=True)" in added
    doc = torch.tensor([0] * 100 + [1] * 156)

    def mask_mod(b, h, q, kv):
        return (doc[q] == doc[kv]) & (q >= kv)

    got = flex.create_block_mask(mask_mod, 1, 1, 256, 256, device="cpu", BLOCK_SIZE=64, separate_full_blocks=True)
    want = real(mask_mod, 1, 1, 256, 256, device="cpu", BLOCK_SIZE=64)
    assert got.to_dense().equal(want.to_dense()) and got.full_kv_num_blocks.equal(want.full_kv_num_blocks)
    with pytest.raises(NotImplementedError, match="separate_full_blocks=False"):
        flex.create_block_mask(mask_mod, 1, 1, 256, 256, device="cpu", separate_full_blocks=False)
    monkeypatch.setattr(flex, "create_block_mask", real)  # a torch that takes the keyword is left alone
    assert "create_block_mask(separate_full_blocks=True)" not in td.install_torch_compat()
    assert flex.create_block_mask is real


def test_dense_spec_round_trips_through_the_environment(monkeypatch):
    spec = td.DenseSpec(dump_folder="d", metrics_jsonl="d/m.jsonl", n_layers=30, local_batch_size=2)
    monkeypatch.setenv(td.SPEC_ENV, spec.to_env())
    assert td.DenseSpec.from_env() == spec


@pytest.mark.slow
def test_smoke_run_through_the_command_line(tmp_path):
    """Both trainers really run (titanloop's and torchtitan's, through the harness, sdpa on the CPU)."""
    out = tmp_path / "lvd.json"
    cmd = [
        sys.executable,
        "benchmarks/gpu_throughput.py",
        "--vs-dense",
        "--smoke",
        "--launches",
        "1",
        "--steps",
        "4",
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = validate(out, json.loads(out.read_text()))
    assert [r[-1] for r in doc["tables"][0]["rows"]] == ["ok", "ok"] and isinstance(
        doc["summary"][0]["measured"], float
    )
