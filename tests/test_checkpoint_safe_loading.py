"""No checkpoint load executes code: crafted malicious checkpoints are refused by every load path.

Two attacks, each a checkpoint whose files are otherwise consistent (the attacker rewrites the manifest's sizes
and checksums too):
  metadata  DCP's `.metadata` is a pickle whose unpickling runs a command;
  entry     a DCP non-tensor entry (which DCP stores with torch.save) whose unpickling runs a command, under a
            key where a tensor is expected (titanloop checkpoints) or as plain data (a plain DCP directory).
Load paths: the trainer's resume (Checkpointer.load_latest, what the training loop calls at start; the real
trainer on a crafted checkpoint is in tests/test_train_preemption.py), evaluation's `load_model` (also what a
staged run's `init_from` and `upcycle` of a training checkpoint use), the `upcycle` CLI on a plain DCP
directory, and the Ouro HF importer (safetensors only; a pickled `pytorch_model.bin` is never opened).
Plus the CI check that no code in the repository calls an unpickler outside titanloop/checkpoint/safe_reader.py.
"""

import ast
import pickle
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from titanloop.checkpoint import CheckpointConfig, Checkpointer, layout
from titanloop.checkpoint.state import ModelState, OptimizerState, rng_state_tensors, split_state
from titanloop.config_errors import ConfigError
from titanloop.checkpoint.loading import load_model
from titanloop.model import build_looplm, preset
from titanloop.recipe import upcycle

ROOT = Path(__file__).resolve().parents[1]


def _model_and_opt():
    torch.manual_seed(0)
    model = build_looplm(preset("debug-tiny", vocab_size=64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randint(0, 64, (1, 8))).readouts[-1].sum().backward()
    opt.step()
    return model, opt


def _checkpointer(run_dir, model, opt):
    return Checkpointer(
        CheckpointConfig(mode="sync"),
        run_dir,
        {"model": model, "optimizer": opt},
        config={"model": {"preset": "debug-tiny", "vocab_size": 64}},
    )


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("clean")
    model, opt = _model_and_opt()
    ckpt = _checkpointer(run, model, opt)
    ckpt.save(1, sync=True)
    ckpt.close()
    return run


def _crafted(clean_run: Path, tmp_path: Path, attack: str, hostile) -> tuple[Path, Path]:
    """A copy of the clean run dir with step-1 replaced by the attack; returns (run dir, marker path)."""
    run, marker = tmp_path / "run", tmp_path / "pwned"
    shutil.copytree(clean_run, run)
    step = run / "checkpoints" / layout.step_dir_name(1)
    if attack == "metadata":
        (step / ".metadata").write_bytes(pickle.dumps(hostile.payload(marker)))
    else:  # rewrite the DCP data as Checkpointer.save writes it, with one model tensor replaced by an object
        model, opt = _model_and_opt()
        entries = {}
        split_state(ModelState(model).state_dict(), "model", entries)
        split_state(OptimizerState(model, opt).state_dict(), "optimizer", entries)
        entries.update(rng_state_tensors(0))
        entries["model/embed_tokens.weight"] = hostile.payload(marker)
        for p in step.glob("*.distcp"):
            p.unlink()
        dcp.save(entries, checkpoint_id=str(step), no_dist=True)
    hostile.refresh_manifest(step)
    return run, marker


@pytest.mark.parametrize("attack", ["metadata", "entry"])
def test_trainer_resume_refuses_malicious_checkpoint(clean_run, tmp_path, attack, hostile):
    run, marker = _crafted(clean_run, tmp_path, attack, hostile)
    model, opt = _model_and_opt()
    ckpt = _checkpointer(run, model, opt)
    with pytest.raises(ConfigError) as e:
        ckpt.load_latest()
    assert not marker.exists(), "loading the checkpoint executed code"
    assert "\n" not in str(e.value) and "step-00000001" in str(e.value)


@pytest.mark.parametrize("attack", ["metadata", "entry"])
def test_eval_loader_refuses_malicious_checkpoint(clean_run, tmp_path, attack, hostile):
    run, marker = _crafted(clean_run, tmp_path, attack, hostile)
    with pytest.raises(ConfigError) as e:
        load_model(run / "checkpoints")
    assert not marker.exists(), "loading the checkpoint executed code"
    assert "\n" not in str(e.value) and "step-00000001" in str(e.value)
    assert load_model(clean_run / "checkpoints").cfg.vocab_size == 64  # the clean one loads


@pytest.mark.parametrize("attack", ["metadata", "entry"])
def test_upcycle_cli_refuses_malicious_checkpoints(clean_run, tmp_path, attack, capsys, hostile):
    # a titanloop training checkpoint (read through load_model, written out as an Ouro HF directory)
    run, marker = _crafted(clean_run, tmp_path, attack, hostile)
    assert upcycle.main([str(run / "checkpoints"), str(tmp_path / "out1")]) == 2
    # a plain DCP directory (read entry by entry, plain data included)
    plain = tmp_path / "plain"
    state = {f"model.{k}": v for k, v in _model_and_opt()[0].state_dict().items()}
    state["optimizer.param_groups.lr"] = hostile.payload(marker) if attack == "entry" else 1e-3
    dcp.save(state, checkpoint_id=str(plain), no_dist=True)
    if attack == "metadata":
        (plain / ".metadata").write_bytes(pickle.dumps(hostile.payload(marker)))
    assert upcycle.main([str(plain), str(tmp_path / "out2")]) == 2
    assert not marker.exists(), "upcycle executed code from the checkpoint"
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("error: ") for line in err), err
    expected = "refusing to load" if attack == "metadata" else "is not plain data, refusing to load it"
    assert expected in err[1]


def test_ouro_hf_importer_never_unpickles(tmp_path, hostile):
    from titanloop.interchange.ouro_hf import export_ouro_hf

    good = tmp_path / "hf"
    export_ouro_hf(build_looplm(preset("debug-tiny")), good)
    bad = tmp_path / "bad"
    bad.mkdir()
    shutil.copy(good / "config.json", bad / "config.json")
    torch.save({"model.embed_tokens.weight": hostile.payload(tmp_path / "pwned")}, bad / "pytorch_model.bin")
    with pytest.raises(ConfigError, match="has no model.safetensors"):
        load_model(bad)
    assert not (tmp_path / "pwned").exists()


# ----- the CI check: no unpickling outside the restricted reader ---------------------------------------------
SAFE_READER = "titanloop/checkpoint/safe_reader.py"


def unsafe_load_calls(path: Path, source: str) -> list[str]:
    """`torch.load(` without weights_only=True, `pickle.load(s)`, and (outside the restricted reader) DCP loads
    that do not go through it. Returns 'file:line: what' for each."""
    bad = []
    for node in ast.walk(ast.parse(source, str(path))):
        if (
            isinstance(node, ast.ImportFrom)
            and node.module == "pickle"
            and any(a.name in ("load", "loads", "Unpickler") for a in node.names)
        ):
            bad.append(f"{path}:{node.lineno}: from pickle import {', '.join(a.name for a in node.names)}")
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        owner = node.func.value.id if isinstance(node.func.value, ast.Name) else None
        name = f"{owner}.{node.func.attr}"
        if name == "torch.load":
            safe = any(
                k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                for k in node.keywords
            )
            if not safe:
                bad.append(f"{path}:{node.lineno}: torch.load( without weights_only=True")
        elif name in ("pickle.load", "pickle.loads"):
            bad.append(f"{path}:{node.lineno}: {name}(")
        elif str(path) != SAFE_READER and (
            name == "dcp.load" or node.func.attr in ("FileSystemReader", "_load_state_dict_from_keys", "read_metadata")
        ):
            bad.append(f"{path}:{node.lineno}: {name}( outside {SAFE_READER} (use load_dcp / read_dcp_entries)")
    return bad


def test_no_unsafe_load_calls_in_the_repository():
    files = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    assert SAFE_READER in files
    bad = [b for f in files for b in unsafe_load_calls(Path(f), (ROOT / f).read_text())]
    assert not bad, "unsafe checkpoint loading:\n" + "\n".join(bad)


def test_unsafe_load_check_catches_each_form():
    src = (
        "import torch, pickle\nfrom pickle import loads\ntorch.load(f)\ntorch.load(f, weights_only=False)\n"
        "torch.load(f, weights_only=True)\npickle.load(f)\ndcp.load(sd, checkpoint_id=p)\n"
    )
    found = unsafe_load_calls(Path("x.py"), src)
    assert [line.split(":")[1] for line in found] == ["2", "3", "4", "6", "7"], found
