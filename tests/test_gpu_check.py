"""titanloop.gpu_check: the parts that need no GPU (the no-CUDA exit, model choice by free memory, the
throughput/MFU arithmetic, the PASS/FAIL table and exit status)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from titanloop import gpu_check as gc
from titanloop.model import preset


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the no-CUDA path cannot be shown")
def test_without_cuda_one_line_and_nonzero_exit():
    proc = subprocess.run(["bash", "scripts/gpu_check.sh"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHON": sys.executable})
    assert proc.returncode == 1
    assert proc.stdout.strip().splitlines() == [gc.no_cuda_message()] and proc.stderr == ""


def test_pick_model_by_free_memory():
    assert gc.pick_model(80 * gc.GIB, 8) == ("ouro-1.4b", {})
    assert gc.pick_model(80 * gc.GIB, 1) == ("ouro-1.4b", {})  # 1.4B x 16 B = 22 GB + looped stack + 16 GiB
    assert gc.pick_model(30 * gc.GIB, 1) == ("ouro-1.4b", {"n_layers": 12})  # 23.7 GiB + 16 GiB does not fit
    assert gc.pick_model(1 * gc.GIB, 1) == ("debug-small", {})
    one, eight = gc.state_bytes(preset("ouro-1.4b"), 1), gc.state_bytes(preset("ouro-1.4b"), 8)
    assert one > 16 * 1.3e9 and eight < one / 2  # FSDP2 shards the fp32 state


def test_throughput_uses_the_flop_model_and_skips_the_compile_step():
    cfg = preset("ouro-1.4b")
    rows = [{"step": 1, "tokens_per_s": 1.0}, {"step": 5, "tokens_per_s": 8000.0}, {"step": 10, "tokens_per_s": 8000.0}]
    tok_s, mfu = gc.throughput(rows, cfg, 4096, 8, 4, 989e12)
    assert tok_s == 1000.0
    assert mfu == pytest.approx(8000.0 * cfg.flops_per_token(4096, n_loops=4) / (989e12 * 8))


def test_table_and_exit_status():
    checks = [gc.Check("flash-attn", True, "importable"), gc.Check("varlen", False, "max |err| 1"),
              gc.Check("memory plan T=4", None, "hook")]
    table = gc.format_table(checks).splitlines()
    assert table[2].split()[:2] == ["flash-attn", "PASS"] and table[3].split()[:2] == ["varlen", "FAIL"]
    assert table[4].split()[3] == "n/a"
    assert gc.exit_status(checks) == 1
    assert gc.exit_status([checks[0], checks[2]]) == 0
    assert gc.exit_status([checks[2]]) == 1  # only hooks: nothing was checked



def test_memory_plan_check_verdicts():
    assert gc.memory_plan_check("m", 10.0, 9.0).ok  # +11%: within 15%
    assert gc.memory_plan_check("m", 12.0, 10.0).ok is False  # +20%
    assert gc.memory_plan_check("m", 7.0, 10.0).ok is False  # -30%: the plan is too pessimistic, also a FAIL
    missing = gc.memory_plan_check("m", None, 10.0)
    assert missing.ok is False and "missing" in missing.detail  # a run that logged no peak is not a pass


def test_planned_peak_of_the_gpu_check_runs(tmp_path):
    """The memory plan accepts exactly the training arguments gpu_check uses (compile on, 2 GPUs) and grows with the
    sequence length and the loop count (activations), so the check compares against a real plan."""
    base = gc.planned_peak_gib(gc.TRAIN_CONFIG, gc.train_args(tmp_path, "debug-small", {}, 4, 256, 2), 2)
    longer = gc.planned_peak_gib(gc.TRAIN_CONFIG, gc.train_args(tmp_path, "debug-small", {}, 4, 1024, 2), 2)
    deeper = gc.planned_peak_gib(gc.TRAIN_CONFIG, gc.train_args(tmp_path, "debug-small", {}, 8, 1024, 2), 2)
    assert 0 < base < longer < deeper, (base, longer, deeper)
