"""benchmarks/nanogpt.py without a nanoGPT checkout: its argument checks, the held-out scoring both models share,
nanoGPT's data files, and the summary's verdicts
(the measured run: benchmarks/results/2026-12-02-cpu-nanogpt.json)."""

import math
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import nanogpt  # noqa: E402  (benchmarks/nanogpt.py)


def test_a_directory_that_is_no_nanogpt_checkout_is_refused(tmp_path):
    proc = subprocess.run(
        [sys.executable, "benchmarks/nanogpt.py", "--nanogpt", str(tmp_path)], cwd=REPO, capture_output=True, text=True
    )
    assert proc.returncode == 2 and "no train.py there; pass a checkout of karpathy/nanoGPT" in proc.stderr


def test_windows_score_every_target_once_and_the_loss_is_the_mean_ce():
    ids = list(range(10)) * 14  # 140 tokens: 2 windows of 64 inputs, 128 targets
    x, y = nanogpt.windows(ids)
    assert x.shape == y.shape == (2, 64) and torch.equal(y.flatten(), torch.tensor(ids[1:129]))
    uniform = nanogpt.heldout_loss(lambda xb: torch.zeros(*xb.shape, 10), x, y, batch=1)
    assert uniform == pytest.approx(math.log(10))  # a model that knows nothing: ln V per character
    exact = nanogpt.heldout_loss(lambda xb: 50.0 * torch.nn.functional.one_hot((xb + 1) % 10, 10).float(), x, y)
    assert exact < 1e-6


def test_nanogpt_data_is_the_same_split_in_its_format(tmp_path):
    nanogpt.prepare_nanogpt_data(tmp_path)
    d = tmp_path / "data" / "shakespeare_char"
    train, val = nanogpt.corpus_text()
    chars = sorted(set(train + val))
    assert len(chars) == 65 and len(train) == 1003854 and len(val) == 111540
    meta = {"vocab_size": 65, "itos": dict(enumerate(chars)), "stoi": {c: i for i, c in enumerate(chars)}}
    assert (d / "meta.pkl").read_bytes() == pickle.dumps(meta)  # what nanoGPT's prepare.py writes, byte for byte
    got = np.fromfile(d / "val.bin", dtype=np.uint16)
    assert "".join(chars[int(i)] for i in got) == val


def test_summary_verdicts_follow_the_numbers():
    def run(i, tl_loss, tl_tps):
        return {
            "run": i,
            "order": "x",
            "nanogpt": {"heldout": 1.88, "tokens_per_s": 20000.0, "wall_s": 70.0},
            "titanloop": {"heldout": tl_loss, "tokens_per_s": tl_tps, "wall_s": 80.0},
            "titanloop_compile": {"heldout": tl_loss, "tokens_per_s": 2 * tl_tps, "wall_s": 90.0},
        }

    args = type("A", (), {"steps": 2000, "threads": 2})()
    good = nanogpt.summarize(args, [run(0, 1.72, 21000.0), run(1, 1.73, 19000.0), run(2, 1.74, 20500.0)])
    assert [r["met"] for r in good["summary"][:2]] == [True, True]
    assert good["summary"][1]["measured"] == 1.025  # the median run's ratio
    slow = nanogpt.summarize(args, [run(0, 1.90, 15000.0)])
    assert [r["met"] for r in slow["summary"][:2]] == [False, False] and slow["summary"][2]["measured"] == 1.5


def test_the_op_profile_splits_aten_ops_into_its_named_kinds():
    """Each profiled op counts once, in the first kind it matches (the op names are named once, in OP_KINDS)."""
    kinds = {op: nanogpt.op_kind(op) for op in ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul")}
    assert kinds == {"aten::mm": "matmul", "aten::addmm": "matmul", "aten::bmm": "matmul", "aten::matmul": "other"}
    assert nanogpt.op_kind("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert nanogpt.op_kind("aten::add_") == "other" and list(nanogpt.OP_KINDS) == ["matmul", "attention"]
