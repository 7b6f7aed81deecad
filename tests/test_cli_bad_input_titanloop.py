"""Bad input to titanloop's command-line tools never loses data, never gives a silent wrong answer, never hangs.

One parametrized test per CLI (`titanloop.eval sweep`, `titanloop.eval generate`, `titanloop.interchange`,
`titanloop.checks`, `titanloop.train`) over missing, empty and binary files, corrupt checkpoints (a flipped byte, a
cut file, a NaN weight), a tokenizer other than the checkpoint's, and outputs that already exist. Every case runs
the real command in a subprocess under a timeout, in a directory holding everything the cases read, and asserts: a
nonzero exit, one `error:` line naming the problem, no Python traceback, and every file that existed before
unchanged (the directory tree hashed before and after; a refused command writes nothing new either, the trainer
aside, which may start its run dir).

The inputs are built once for the module, in this process and without training: a one-layer debug-tiny LoopLM
saved as a titanloop DCP checkpoint (its config names tokenizer A) and exported as an Ouro HF directory, two
character tokenizers (A, B) and a shard set of each.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from subprocess import DEVNULL

import pytest
import torch

from launch import environment
from titanloop.checkpoint import CheckpointConfig, Checkpointer
from titanloop.interchange import export_ouro_hf
from titanloop.model import LoopLM, preset
from titanloop.train.launch import torchrun

REPO = Path(__file__).resolve().parents[1]
TIMEOUT = 300  # seconds per command: a hang fails the case instead of the suite
TINY_CHECKS = ["--shape", "debug-tiny", "--seq-len", "64", "--precisions", "bf16", "--no-memory-runs"]


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x7F  # the middle of the tensor bytes: a weight changes, the file still parses
    path.write_bytes(bytes(data))


def _cut(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    from safetensors.torch import load_file, save_file

    from data_pipelines import tokenize, tokenizer

    root = tmp_path_factory.mktemp("bad_input")
    (root / "a.txt").write_text("the quick brown fox jumps over the lazy dog.\n" * 20)
    (root / "b.txt").write_text("ZYXWVUTSRQ 0123456789 !?\n" * 20)
    for name in ("a", "b"):
        tokenizer.main(["char", "--out", str(root / f"tok_{name}.json"), str(root / f"{name}.txt")])
        tokenize.main(
            ["--tokenizer", str(root / f"tok_{name}.json"), "--out", str(root / f"shards_{name}"), "--workers", "1"]
            + [str(root / f"{name}.txt")]
        )
    section = {"preset": "debug-tiny", "vocab_size": 64, "n_layers": 1}
    torch.manual_seed(0)
    model = LoopLM(preset("debug-tiny", vocab_size=64, n_layers=1)).eval()
    config = {"model": section, "data": {"tokenizer": str(root / "tok_a.json")}}
    ck = Checkpointer(CheckpointConfig(mode="sync"), root / "run", {"model": model}, config=config)
    ck.save(1, sync=True)
    ck.close()
    export_ouro_hf(model, root / "hf")
    shutil.copyfile(root / "tok_a.json", root / "hf" / "tokenizer.json")

    # corrupt copies: a flipped byte and a cut file in the DCP checkpoint; a cut safetensors file, a binary
    # config.json and a NaN weight in the HF directory
    distcp = Path("checkpoints/step-00000001/__0_0.distcp")
    for name, spoil in (("flip", _flip_byte), ("cut", _cut)):
        shutil.copytree(root / "run", root / name)
        spoil(root / name / distcp)
    for name in ("hf_cut", "hf_binconfig", "hf_nan"):
        shutil.copytree(root / "hf", root / name)
    _cut(root / "hf_cut" / "model.safetensors")
    (root / "hf_binconfig" / "config.json").write_bytes(bytes(range(256)) * 4)
    tensors = load_file(str(root / "hf_nan" / "model.safetensors"))
    tensors[sorted(tensors)[0]].view(-1)[3] = float("nan")
    save_file(tensors, str(root / "hf_nan" / "model.safetensors"), metadata={"format": "pt"})

    # plain inputs and earlier outputs
    (root / "bin.jsonl").write_bytes(bytes(range(256)) * 4)
    (root / "bin.json").write_bytes(bytes(range(256)) * 4)
    (root / "empty.json").write_text("")
    (root / "empty.jsonl").write_text("")
    (root / "seqs.jsonl").write_text("\n".join(json.dumps([i % 20 + 1 for i in range(k, k + 12)]) for k in range(4)))
    (root / "emptydir").mkdir()
    (root / "afile.txt").write_text("not a directory\n")
    (root / "sweep_prev").mkdir()
    (root / "sweep_prev" / "report.json").write_text('{"an": "earlier sweep"}\n')
    (root / "sweep_prev" / "depth_curve.png").write_bytes(b"an earlier plot")
    shutil.copytree(root / "hf", root / "export_prev")  # an earlier export, with its tokenizer.json
    (root / "checks_prev.json").write_text('{"plans": {}}\n')

    debug = (REPO / "train_configs" / "debug.toml").read_text()
    for name, source in (("missing_data", "nope"), ("other_tokenizer", "shards_b")):
        data = f'kind = "shards"\ntokenizer = "{root / "tok_a.json"}"\n[[data.sources]]\npath = "{root / source}"'
        text, n = re.subn(r'(?m)^kind = "synthetic_text".*$', data.replace("\\", "\\\\"), debug)
        assert n == 1, "train_configs/debug.toml no longer reads [data] kind = synthetic_text"
        (root / f"{name}.toml").write_text(text)
    return root


def tree(root: Path) -> dict[str, str]:
    """Every file (its sha1) and directory under root, by relative path."""
    out = {}
    for p in sorted(root.rglob("*")):
        out[str(p.relative_to(root))] = hashlib.sha1(p.read_bytes()).hexdigest() if p.is_file() else "dir"
    return out


def py(*args: str) -> list[str]:
    return [sys.executable, "-m", *args]


SWEEP_FAST = ["--loops", "1", "--device", "cpu", "--no-diagnostics", "--max-batches", "1", "--seq-len", "8"]
GENERATE_FAST = ["--max-new-tokens", "2", "--device", "cpu"]
DEBUG_TOML = str(REPO / "train_configs" / "debug.toml")
NO_TORCHRUN = {k: None for k in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "TITANLOOP_DEBUG")}

# CLI -> case -> (command, what the one error line must say); run in a copy of `world`
CASES = {
    "sweep": {
        "missing-checkpoint": (["nope", "--data", "seqs.jsonl", "--out", "o"], "does not exist"),
        "binary-data": (["hf", "--data", "bin.jsonl", "--out", "o"], "is not a UTF-8 text file"),
        "bitflipped-checkpoint": (["flip/checkpoints", "--data", "seqs.jsonl", "--out", "o"], "crc32 mismatch"),
        "other-tokenizer-shards": (["run/checkpoints", "--data", "shards_b", "--out", "o"], "not the checkpoint's"),
        "existing-out": (["hf", "--data", "seqs.jsonl", "--out", "sweep_prev"], "is not empty"),
        # checked before the model loads: with a cut checkpoint, the loader would fail first
        "out-is-a-file-first": (["cut/checkpoints", "--data", "seqs.jsonl", "--out", "afile.txt"], "is a file"),
        "loops-0-first": (["cut/checkpoints", "--data", "seqs.jsonl", "--out", "o", "--loops", "0"], "loops=0"),
    },
    "generate": {
        "binary-config": (["hf_binconfig", "--prompt-ids", "1,2"], "not a JSON text file"),
        "truncated-checkpoint": (["cut/checkpoints", "--prompt-ids", "1,2"], "truncated"),
        "bitflipped-checkpoint": (["flip/checkpoints", "--prompt", "the fox"], "crc32 mismatch"),
        "nonfinite-weight": (["hf_nan", "--prompt-ids", "1,2"], "non-finite"),
        "other-tokenizer": (
            ["run/checkpoints", "--prompt", "the", "--tokenizer", "tok_b.json"],
            "not the checkpoint's",
        ),
        "unknown-characters": (
            ["hf", "--prompt", "the f\u00f6x \u20ac"],
            "2 character(s) the tokenizer lacks ('\u00f6'",
        ),
        "binary-tokenizer": (["hf", "--prompt", "the", "--tokenizer", "bin.json"], "is not a text file"),
        "empty-tokenizer": (["hf", "--prompt", "the", "--tokenizer", "empty.json"], "is not valid JSON"),
    },
    "interchange": {
        "inspect-missing": (["inspect", "nope"], "path='nope' is invalid"),
        "inspect-binary-config": (["inspect", "hf_binconfig"], "not a JSON text file"),
        "inspect-truncated-safetensors": (["inspect", "hf_cut"], "not a readable safetensors file"),
        "verify-binary-config": (["verify", "hf_binconfig"], "not a JSON text file"),
        "verify-truncated-safetensors": (["verify", "hf_cut"], "not a readable safetensors file"),
        "verify-nonfinite-weight": (["verify", "hf_nan"], "non-finite"),
        "export-bitflipped-checkpoint": (
            ["export", "--checkpoint", "flip/checkpoints", "--out", "x"],
            "crc32 mismatch",
        ),
        "export-existing-out": (["export", "--checkpoint", "run/checkpoints", "--out", "export_prev"], "is not empty"),
        # checked before the model loads: with a cut checkpoint, the loader would fail first
        "export-out-is-a-file-first": (
            ["export", "--checkpoint", "cut/checkpoints", "--out", "afile.txt"],
            "is a file",
        ),
        "export-onto-its-checkpoint": (["export", "--checkpoint", "hf", "--out", "hf/", "--overwrite"], "itself"),
        "export-binary-tokenizer": (["export", "--tokenizer", "bin.json", "--out", "x"], "is not a text file"),
    },
    "checks": {
        "existing-out": (["--rows", "plans", *TINY_CHECKS, "--out", "checks_prev.json"], "exists"),
        "out-is-a-directory": (["--rows", "plans", *TINY_CHECKS, "--out", "emptydir"], "is a directory"),
        "out-is-its-plans": (
            ["--rows", "plans", *TINY_CHECKS, "--plans", "checks_prev.json", "--out", "./checks_prev.json"]
            + ["--overwrite"],
            "is --plans itself",
        ),
    },
    "train": {
        "missing-data-path": (
            torchrun(1, "-m", "titanloop.train", "--config", "missing_data.toml", "--training.run_dir", "r"),
            "nope/manifest.json: missing",
        ),
        "other-tokenizer-shards": (
            torchrun(1, "-m", "titanloop.train", "--config", "other_tokenizer.toml", "--training.run_dir", "r"),
            "shards_b/manifest.json: was written with tokenizer",
        ),
    },
    "other": {
        "retrofit-export-existing-out": (
            py("titanloop.retrofit", "export", "--checkpoint", "run/checkpoints", "--out", "export_prev"),
            "is not empty",
        ),
        "zero-import-into-a-run-with-checkpoints": (
            py("titanloop.train.zero_import", "nope", "--config", DEBUG_TOML, "--out", "run"),
            "already holds checkpoints",
        ),
        "upcycle-truncated-checkpoint": (py("titanloop.recipe.upcycle", "cut/checkpoints", "x"), "truncated"),
        "upcycle-existing-out": (py("titanloop.recipe.upcycle", "run/checkpoints", "export_prev"), "is not empty"),
    },
}
PREFIX = {
    "sweep": lambda a: py("titanloop.eval", "sweep", *a, *(SWEEP_FAST[2:] if "--loops" in a else SWEEP_FAST)),
    "generate": lambda a: py("titanloop.eval", "generate", *a, *GENERATE_FAST),
    "interchange": lambda a: py("titanloop.interchange", *a),
    "checks": lambda a: py("titanloop.checks", *a),
    "train": lambda a: a,
    "other": lambda a: a,
}
# commands that succeed, with what they must have done (checked in their tests)
GOOD = {
    "allow-unknown": py("titanloop.eval", "generate", "hf", "--prompt", "the f\u00f6x \u20ac", "--allow-unknown")
    + GENERATE_FAST,
    "export-overwrite": py("titanloop.interchange", "export", "--preset", "debug-tiny", "--out", "export_prev")
    + ["--overwrite"],
}
PARALLEL = 4  # commands at a time (each mostly imports torch); the whole matrix takes about its CPU time / cores


def _run(world: Path, where: Path, argv: list[str], env) -> tuple:
    """argv in a fresh copy of `world` under a timeout: (process or the TimeoutExpired, tree before, tree after)."""
    shutil.copytree(world, where, symlinks=True)
    before = tree(where)
    try:
        proc = subprocess.run(
            argv, cwd=where, env=environment(env), capture_output=True, text=True, timeout=TIMEOUT, stdin=DEVNULL
        )
    except subprocess.TimeoutExpired as e:
        proc = e
    return proc, before, tree(where)


@pytest.fixture(scope="module")
def results(world, tmp_path_factory) -> dict:
    """Every command of the matrix, PARALLEL at a time, each in its own copy of `world` (so each case's tree is its
    own); the shared inputs themselves are hashed before and after."""
    base = tmp_path_factory.mktemp("cases")
    jobs = {
        f"{cli}/{case}": (PREFIX[cli](args), NO_TORCHRUN) for cli in CASES for case, (args, _) in CASES[cli].items()
    }
    jobs.update({f"good/{name}": (argv, None) for name, argv in GOOD.items()})
    shared = tree(world)
    with ThreadPoolExecutor(PARALLEL) as pool:
        futures = {
            k: pool.submit(_run, world, base / k.replace("/", "__"), argv, env) for k, (argv, env) in jobs.items()
        }
        out = {k: f.result() for k, f in futures.items()}
    out["shared-inputs"] = (shared, tree(world))
    return out


def check_refused(results: dict, cli: str, case: str) -> None:
    """Nonzero exit, one `error:` line naming the problem, no traceback, nothing that existed changed; a refused
    command writes nothing new either (the trainer aside: it may start its run dir)."""
    proc, before, after = results[f"{cli}/{case}"]
    needle = CASES[cli][case][1]
    assert not isinstance(proc, subprocess.TimeoutExpired), f"no answer in {TIMEOUT} s: {proc.stderr!r}"[-3000:]
    err = proc.stderr
    assert proc.returncode != 0, f"exit 0 for bad input:\n{proc.stdout[-2000:]}\n{err[-2000:]}"
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0], err[-3000:]
    if proc.args[1:3] == ["-m", "torch.distributed.run"]:
        # torchrun reports a failed worker with a traceback of its own ("ChildFailedError"); the worker prints none
        assert "[rank0]" not in err, err[-3000:]
        assert err.count("Traceback") == err.count("ChildFailedError: ") <= 1, err[-3000:]
    else:
        assert "Traceback" not in err, err[-3000:]
    changed = sorted(k for k in before if after.get(k) != before[k])
    assert not changed, f"changed or removed by a refused command: {changed}"
    if cli != "train":
        assert sorted(set(after) - set(before)) == [], "a refused command wrote files"


@pytest.mark.parametrize("case", sorted(CASES["sweep"]))
def test_eval_sweep_bad_input(results, case):
    check_refused(results, "sweep", case)


@pytest.mark.parametrize("case", sorted(CASES["generate"]))
def test_eval_generate_bad_input(results, case):
    check_refused(results, "generate", case)


@pytest.mark.parametrize("case", sorted(CASES["interchange"]))
def test_interchange_bad_input(results, case):
    check_refused(results, "interchange", case)


@pytest.mark.parametrize("case", sorted(CASES["checks"]))
def test_checks_bad_input(results, case):
    check_refused(results, "checks", case)


@pytest.mark.parametrize("case", sorted(CASES["train"]))
def test_train_start_up_errors_are_one_line(results, case):
    """One line from rank 0 (the trainer's traceback only with --debug / TITANLOOP_DEBUG=1)."""
    check_refused(results, "train", case)


@pytest.mark.parametrize("case", sorted(CASES["other"]))
def test_other_clis_bad_input(results, case):
    """The retrofit export, the DeepSpeed-checkpoint import and the upcycling command."""
    check_refused(results, "other", case)


def test_the_shared_inputs_are_unchanged(results):
    before, after = results["shared-inputs"]
    assert before == after


def test_eval_generate_allow_unknown_warns_with_the_count(results):
    proc, _, _ = results["good/allow-unknown"]
    assert proc.returncode == 0, proc.stderr
    assert "warning: --prompt has 2 character(s) the tokenizer lacks" in proc.stderr


def test_export_overwrite_replaces_the_model_and_its_tokenizer(results):
    """--overwrite replaces an earlier export: new weights, and no tokenizer.json of the earlier model beside them
    (eval generate would take it for the new model's)."""
    proc, before, after = results["good/export-overwrite"]
    assert proc.returncode == 0, proc.stderr
    assert "export_prev/tokenizer.json" in before and "export_prev/tokenizer.json" not in after
    assert after["export_prev/model.safetensors"] != before["export_prev/model.safetensors"]
    assert after["export_prev/config.json"] != before["export_prev/config.json"]
