"""The one MFU (titanloop.train.mfu): each device's bf16 dense peak, torchtitan's figure for every part its table
names, n/a for a device it does not know, and the trainer's metrics and startup line reading it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from titanloop.train import mfu

DEBUG = Path(__file__).resolve().parents[1] / "train_configs" / "debug.toml"

# the names torch.cuda.get_device_name reports (one or more per PEAKS entry), and the peak each must get
DEVICES = {
    "NVIDIA GB200": 2.5e15,
    "NVIDIA GB300": 2.5e15,
    "NVIDIA B300 SXM6 AC": 2.25e15,
    "NVIDIA B200": 2.25e15,
    "NVIDIA H100 NVL": 835e12,
    "NVIDIA H100 PCIe": 756e12,
    "NVIDIA H100 80GB HBM3": 989e12,
    "NVIDIA H200": 989e12,
    "NVIDIA GH200 480GB": 989e12,
    "NVIDIA H20": 148e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100 80GB PCIe": 312e12,
    "NVIDIA RTX A6000": 154.85e12,
    "NVIDIA L40S": 362e12,
    "AMD Instinct MI355X": 2500e12,
    "AMD Instinct MI325X": 1300e12,
    "AMD Instinct MI300X": 1300e12,
    "AMD Instinct MI250X": 191.5e12,
}
UNKNOWN = ("cpu", "Tesla V100-SXM2-16GB", "NVIDIA GeForce RTX 4090")


@pytest.mark.parametrize("name", DEVICES)
def test_the_peak_of_every_device_in_the_table(name):
    assert mfu.peak_flops(name) == DEVICES[name]


def test_every_table_entry_is_reached_by_a_device_name():
    """An entry shadowed by an earlier one (e.g. H20 before H200) would never be reached."""
    reached = {next(i for i, (keys, _) in enumerate(mfu.PEAKS) if all(k in n.upper() for k in keys)) for n in DEVICES}
    assert reached == set(range(len(mfu.PEAKS)))


@pytest.mark.parametrize("name", UNKNOWN)
def test_an_unknown_device_has_no_peak(name):
    assert mfu.peak_flops(name) is None
    assert mfu.mfu(1e15, mfu.peak_flops(name), ranks=8) is None
    assert mfu.peak_text(name, None) == f"MFU n/a (no peak known for {name})"


def test_the_figures_are_torchtitans(monkeypatch):
    """torchtitan's get_peak_flops gives the same figure for every known part (it matches "l40s" in lower case
    only), and an A100's for a device it does not know, which is why the table is titanloop's own."""
    from torchtitan.tools import utils

    def no_lspci(*args, **kwargs):  # it reads `lspci` first; on a GPU host that would name that host's GPU
        raise FileNotFoundError("lspci")

    monkeypatch.setattr(subprocess, "run", no_lspci)
    for name, peak in DEVICES.items():
        assert utils.get_peak_flops(name.lower() if "L40S" in name else name) == peak, name
    assert utils.get_peak_flops("Tesla V100-SXM2-16GB") == 312e12


def test_mfu_and_the_startup_text():
    assert mfu.mfu(494.5e12, 989e12) == 0.5
    assert mfu.mfu(989e12, 989e12, ranks=4) == 0.25
    assert mfu.peak_text("NVIDIA H200", 989e12) == "MFU peak: NVIDIA H200 989 TFLOP/s bf16"


def _metrics_row(tmp_path, monkeypatch, gpu: str, world: int = 2) -> dict:
    """The trainer's Metrics callback on a CUDA mesh whose device is named `gpu` (patched: no GPU here): the row
    it writes to metrics.jsonl for one step."""
    from titanloop.train.callbacks import Metrics, StepResult
    from titanloop.train.config import load_config

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: gpu)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 0)
    cfg = load_config(DEBUG, ["--training.run_dir", str(tmp_path), "--metrics.wandb", "off"])
    run = SimpleNamespace(
        cfg=cfg,
        mesh=SimpleNamespace(device_type="cuda", world_size=world, rank=0),
        dataloader=SimpleNamespace(batch_at=lambda i: 16),
        state=SimpleNamespace(skipped_steps=0),
    )
    cb = Metrics(run)
    per_loop = {"ce": [1.0] * 4, "exit_prob": [0.25] * 4, "hidden_rms": [1.0] * 4, "gate_entropy": [1.0]}
    cb.post_step(run, StepResult(step=1, n_loops=4, loss=1.0, per_loop=per_loop, lr=1e-3, seconds=0.5, grad_norm=1.0))
    cb.close()
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["tflops"] == pytest.approx(cfg.family.flops_per_token(64, 4) * 16 * 64 / 0.5 / 1e12, rel=1e-12)
    return row


def test_the_trainers_mfu_uses_the_devices_peak(tmp_path, monkeypatch):
    row = _metrics_row(tmp_path / "h100pcie", monkeypatch, "NVIDIA H100 PCIe")
    assert row["mfu"] == pytest.approx(row["tflops"] * 1e12 / (2 * 756e12), rel=1e-12)
    a100 = _metrics_row(tmp_path / "a100", monkeypatch, "NVIDIA A100-SXM4-80GB")
    assert a100["mfu"] == pytest.approx(row["mfu"] * 756 / 312, rel=1e-12)


def test_the_trainers_mfu_is_na_on_an_unknown_device(tmp_path, monkeypatch, capsys):
    row = _metrics_row(tmp_path, monkeypatch, "Tesla V100-SXM2-16GB")
    assert row["mfu"] is None
    assert "mfu n/a" in capsys.readouterr().out


def test_the_startup_line_names_the_peak(monkeypatch):
    from titanloop.train.__main__ import speed_settings

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    cfg = SimpleNamespace(
        parallelism=SimpleNamespace(activation_checkpoint="loop", ac_kept_loops=0, compile=True, engine="fsdp2"),
        float8=SimpleNamespace(recipe="off"),
        training=SimpleNamespace(micro_batch_size=2, seq_len=4096),
        optimizer=SimpleNamespace(name="adamw", resolved_implementation=lambda device, tp: "fused"),
    )
    run = SimpleNamespace(
        cfg=cfg,
        mesh=SimpleNamespace(device_type="cuda", dims=SimpleNamespace(tp=1)),
        param_dtype=torch.bfloat16,
        dataloader=SimpleNamespace(grad_accum_at=lambda step: 1),
    )
    assert speed_settings(run).endswith("| MFU peak: NVIDIA H200 989 TFLOP/s bf16")
    run.mesh.device_type = "cpu"
    assert speed_settings(run).endswith("| MFU n/a (no peak known for cpu)")
