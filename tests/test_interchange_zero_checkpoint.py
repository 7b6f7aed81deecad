"""A DeepSpeed-native ZeRO-3 checkpoint (engine.save_checkpoint on 2 ranks, written by titanloop's DeepSpeedEngine
in tests/deepspeed_native_driver.py) -> `python -m titanloop.train.zero_import` -> a titanloop DCP
checkpoint -> the Ouro HF export, checked against the independent Ouro forward of tests/test_interchange.py;
and upcycling (stage.init_from + upcycle = "stack") from the imported checkpoint."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from launch import DEBUG, REPO, environment, run
from test_interchange import ouro_reference

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    root = tmp_path_factory.mktemp("zero_import")
    ds_dir, run_dir = root / "deepspeed", root / "imported"
    run(2, str(REPO / "tests" / "deepspeed_native_driver.py"), str(ds_dir), "3", timeout=300)
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "titanloop.train.zero_import",
            str(ds_dir),
            "--config",
            str(DEBUG),
            "--out",
            str(run_dir),
        ],
        cwd=REPO,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert cli.returncode == 0, (cli.stdout + cli.stderr)[-4000:]
    return ds_dir, run_dir, cli.stdout


def test_import_is_exact_and_exports_to_ouro(imported, tmp_path):
    from titanloop.checkpoint.loading import load_model
    from titanloop.interchange import export_ouro_hf

    ds_dir, run_dir, out = imported
    assert f"wrote {run_dir / 'checkpoints' / 'step-00000002'}" in out  # the step from the DeepSpeed tag
    model = load_model(run_dir / "checkpoints")
    reference = load_file(str(ds_dir / "reference.safetensors"))  # the engine's own fp32 weights
    state = model.state_dict()
    assert state.keys() == reference.keys()
    for k in state:
        assert torch.equal(state[k], reference[k]), k
    export_ouro_hf(model, tmp_path / "hf")
    ids = torch.randint(0, model.cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(ids, return_logits="all")
        ref = ouro_reference(tmp_path / "hf", ids)
    for t, (logits, gate) in enumerate(ref):
        torch.testing.assert_close(logits, ours.logits[t], rtol=0, atol=1e-5)
        torch.testing.assert_close(gate, ours.gate_logits[t], rtol=0, atol=1e-5)


def test_upcycle_a_stage_from_the_imported_checkpoint(imported):
    from titanloop.model import LoopLM
    from titanloop.recipe.stages import StageSection, previous_stage_state
    from titanloop.train.config import load_config

    _, run_dir, _ = imported
    small = load_config(DEBUG, world_size=1).looplm
    big = LoopLM(small.replace(n_layers=2 * small.n_layers))
    state = previous_stage_state(StageSection(init_from=str(run_dir / "checkpoints"), upcycle="stack"), big)
    src = load_file(str(imported[0] / "reference.safetensors"))
    for i in range(big.cfg.n_layers):
        key = f"layers.{i}.mlp.up_proj.weight"
        assert torch.equal(state[key], src[f"layers.{i % small.n_layers}.mlp.up_proj.weight"]), key


def test_bad_input_is_one_line(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "titanloop.train.zero_import",
            str(tmp_path),
            "--config",
            str(DEBUG),
            "--out",
            str(tmp_path / "out"),
        ],
        cwd=REPO,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: deepspeed checkpoint") and "\n" not in proc.stderr.strip()
