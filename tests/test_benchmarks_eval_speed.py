"""benchmarks/eval_speed.py: without CUDA one line and exit 1; --smoke runs both rows on the CPU at tiny sizes."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import eval_speed
from benchmarks.report import validate


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: no CUDA-less path to show")
def test_without_cuda_one_line_and_exit_1(capsys):
    assert eval_speed.main([]) == 1 and capsys.readouterr().out.count("\n") == 1


@pytest.mark.slow
def test_smoke_sweeps_the_tokens_asked_for_and_generates_at_both_batches(tmp_path):
    out = tmp_path / "e.json"
    assert eval_speed.main(["--smoke", "--tokens", "300", "--out", str(out)]) == 0
    doc = validate(out, json.loads(out.read_text()))
    sweep, gen = doc["result"]["sweep"], doc["result"]["generation"]
    assert sweep["tokens"] >= 300 and sweep["loops"] == list(range(1, 9)) and sweep["peak_gpu_gb"] is None
    assert [g["batch"] for g in gen] == [1, 16] and doc["title"] == "Evaluation and generation speed" and doc["torch"]
