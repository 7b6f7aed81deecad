"""Every shipped launch command starts at its real size: each slurm/*.sh with its stage config at the nodes x
GPUs it asks for, and every `sbatch` / `torchrun` command of the README, run through the trainer's startup on
torchtitan's fake backend (titanloop.train.dry_run), all in this one process."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from launch import REPO, TRAINER, environment

from titanloop.config_errors import ConfigError
from titanloop.train.config import load_config
from titanloop.train.dry_run import dry_run, slurm_stages


def _sbatch_directive(text: str, pattern: str) -> int:
    m = re.search(rf"^#SBATCH {pattern}", text, re.M)
    assert m, f"no '#SBATCH {pattern}' line"
    return int(m.group(1))


def slurm_launches() -> list[tuple[str, str, int, list[str]]]:
    """(name, config, world size, overrides) of every stage script at its #SBATCH size."""
    return slurm_stages(REPO)


def _commands(markdown: str) -> list[str]:
    """Shell commands of the fenced code blocks, with backslash continuations joined."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", markdown, re.S):
        for cmd in block.replace("\\\n", " ").splitlines():
            lines.append(cmd.split("#", 1)[0].strip())
    return [c for c in lines if c]


def readme_launches() -> list[tuple[str, str, int, list[str]]]:
    """(command, config, world size, overrides) of the README's sbatch and torchrun training commands."""
    out = []
    for cmd in _commands((REPO / "README.md").read_text()):
        words = shlex.split(cmd)
        if words[0] == "sbatch":
            i = next(i for i, w in enumerate(words) if w.startswith("slurm/"))
            text = (REPO / words[i]).read_text()
            nodes = _sbatch_directive(text, r"--nodes=(\d+)")
            for w in words[1:i]:
                if w.startswith("--nodes="):
                    nodes = int(w.split("=", 1)[1])
            config = re.search(r"^STAGE_CONFIG=(\S+)", text, re.M).group(1)
            out.append((cmd, config, nodes * _sbatch_directive(text, r"--gres=gpu:(\d+)"), words[i + 1 :]))
        elif words[:3] == ["python", "-m", "titanloop.train"] and "--dry-run" in words:
            i = words.index("--config")
            rest = [w for w in words[i + 2 :] if w not in ("--dry-run", "--memory-plan")]
            j = rest.index("--world-size")
            out.append((cmd, words[i + 1], int(rest[j + 1]), rest[:j] + rest[j + 2 :]))
        elif words[0] == "torchrun" and "titanloop.train" in words:
            # --opt value and --opt=value alike; one node unless --nnodes says more
            split = [p for w in words for p in (w.split("=", 1) if w.startswith("--") and "=" in w else [w])]
            opts = dict(zip(split, split[1:]))
            i = split.index("--config")
            size = int(opts.get("--nnodes", 1)) * int(opts["--nproc_per_node"])
            out.append((cmd, split[i + 1], size, split[i + 2 :]))
    return out


def test_launch_lists_are_read():
    """The parsers above find what the repo ships (so the dry-run test below cannot pass vacuously)."""
    names = {name for name, *_ in slurm_launches()}
    # a script's own overrides are part of what it launches (the DeepSpeed script sets the engine this way)
    assert {"--parallelism.engine", "deepspeed"} <= {
        w for name, _, _, over in slurm_launches() for w in over if name == "deepspeed_zero3.sh"
    }
    assert {
        "stage1a.sh",
        "stage1b_1p4b.sh",
        "stage1b_2p6b_upcycle.sh",
        "stage2_ct_anneal.sh",
        "stage3_longct.sh",
        "stage4_midtrain.sh",
        "gate_stage2.sh",
    } <= names
    readme = readme_launches()
    assert any(size == 256 and "--training.global_batch_size" in over for _, _, size, over in readme)
    assert sum(cmd.startswith("sbatch") for cmd, *_ in readme) >= 2
    assert any(cmd.startswith("torchrun") for cmd, *_ in readme)
    assert any("--dry-run" in cmd for cmd, *_ in readme)


def _qwen25_3b_config(tmp_path: Path) -> str:
    """A config.json-only directory with Qwen2.5-3B's shape (the retrofit paper's base model): what the dry run of
    slurm/ouroboros_retrofit.sh reads; the weights are never touched on the meta device."""
    from transformers import Qwen2Config

    Qwen2Config(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=11008,
        num_hidden_layers=36,
        num_attention_heads=16,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ).save_pretrained(tmp_path)
    return str(tmp_path)


def test_every_shipped_launch_starts_at_its_size(tmp_path):
    failures, seen = [], set()
    qwen = _qwen25_3b_config(tmp_path)
    for name, config, world_size, overrides in slurm_launches() + readme_launches():
        if "[retrofit]" in (REPO / config).read_text():  # needs the user's checkpoint: its config.json stands in
            overrides = [*overrides, "--retrofit.hf_path", qwen]
        if (config, world_size, tuple(overrides)) in seen:  # the same start as a command already run
            continue
        seen.add((config, world_size, tuple(overrides)))
        try:
            cfg = load_config(REPO / config, overrides, world_size=world_size)
            report = dry_run(cfg, world_size)
        except ConfigError as e:
            failures.append(f"{name} ({config} at {world_size} ranks): {e}")
            continue
        assert f"at world size {world_size}" in report.text()
    assert not failures, "\n".join(failures)


def test_impossible_ramp_names_a_value_that_works():
    with pytest.raises(ConfigError) as e:
        load_config(REPO / "train_configs/stage1a.toml", ["--training.batch_ramp_increment", "128"], world_size=128)
    msg = str(e.value)
    assert "\n" not in msg and "batch_ramp_increment=128" in msg and "e.g. batch_ramp_increment=256" in msg
    load_config(REPO / "train_configs/stage1a.toml", ["--training.batch_ramp_increment", "256"], world_size=128)


def _dry_run_cli(config: str, *args: str) -> subprocess.CompletedProcess:
    """`python -m titanloop.train --config <config> --dry-run <args>` from the repo root, as the docs give it."""
    cmd = [sys.executable, *TRAINER, "--config", config, "--dry-run", *args]
    return subprocess.run(cmd, cwd=REPO, env=environment(), capture_output=True, text=True, timeout=300)


def test_dry_run_command_line():
    """The exact command of the docs: exit 0 with the plan; a bad world size: exit 2 and one line."""
    ok = _dry_run_cli("train_configs/stage1a.toml", "--world-size", "128")
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "mesh dp_shard 128 x tp 1" in ok.stdout and "grad accum 4..8" in ok.stdout
    bad = _dry_run_cli("train_configs/stage1a.toml", "--world-size", "96", "--parallelism.tp", "8")
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and bad.stderr.count("\n") == 1, bad.stderr


def test_memory_plan_command_line_shows_progress_and_refuses_what_does_not_fit():
    """--memory-plan: progress lines on stderr while the fake step runs (a 1.4B plan takes about a minute), the plan
    on stdout; a GPU too small for the plan: exit 2, the error as the last line, nothing on stdout claims success."""
    args = ["--world-size", "2", "--memory-plan", "--training.global_batch_size", "32"]  # 2 micro-batches of 8 per rank
    ok = _dry_run_cli("train_configs/debug.toml", *args)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "memory plan per GPU" in ok.stdout and "memory plan:" not in ok.stdout
    lines = [line for line in ok.stderr.splitlines() if line.startswith("memory plan: ")]
    assert len(lines) >= 4, f"no progress lines on stderr: {ok.stderr[-2000:]}"
    assert lines[0] == "memory plan: forward-backward pass 1 of 3 (optimizer step 1 of 2)", ok.stderr
    assert re.fullmatch(
        r"memory plan: forward-backward pass 3 of 3 \(optimizer step 2 of 2\); \d+ s so far, about \d+ s left", lines[2]
    ), lines
    assert re.fullmatch(r"memory plan: done in \d+ s", lines[-1]), lines
    small = _dry_run_cli("train_configs/debug.toml", *args, "--gpu-mem-gb", "1")
    assert small.returncode == 2 and small.stderr.splitlines()[-1].startswith("error: "), small.stderr
    assert "dry run ok" not in small.stdout
