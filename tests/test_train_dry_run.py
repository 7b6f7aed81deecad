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


# ----- the GPU memory a plan is judged against, and --fit-ac ----------------------------------------------------
def test_the_plan_reads_the_gpu_memory_of_this_machine(monkeypatch):
    """No CUDA device: 80 GB (an H100, what the stage configs target); a device: its own total memory; an explicit
    --gpu-mem-gb wins over both. The dry run's plan is judged against it and says where it came from."""
    import torch

    from titanloop.train import memory_plan as mp

    assert mp.gpu_memory_gb(None) == (80.0, "no GPU here: the default, an H100's 80 GB; --gpu-mem-gb sets another")
    props = type("Props", (), {"name": "NVIDIA H200", "total_memory": 150_754_820_096})()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    assert mp.local_gpu() == ("NVIDIA H200", 150.754820096)
    assert mp.gpu_memory_gb(None) == (150.754820096, "NVIDIA H200, this machine's GPU")
    assert mp.gpu_memory_gb(141.0) == (141.0, "--gpu-mem-gb")
    monkeypatch.undo()  # the dry run itself must not believe in CUDA here; only local_gpu reports a device
    monkeypatch.setattr(mp, "local_gpu", lambda: ("NVIDIA H200", 150.754820096))
    plan = dry_run(load_config(REPO / "train_configs/debug.toml", [], world_size=2), 2, memory_plan=True).memory_plan
    assert plan.gpu_mem_gb == 150.754820096 and "fits in 151 GB per GPU" in plan.verdict
    assert "note: GPU memory 150.8 GB (NVIDIA H200, this machine's GPU)" in plan.text()


def test_fit_ac_names_the_least_recomputation_that_fits(monkeypatch):
    """--fit-ac against plans made one by one: no AC where it fits, else selective AC, else per-loop AC keeping the
    most loops that fit; at most ceil(log2(T + 2)) + 1 plans for each answer. (The search's dry runs are the real
    plans, each made once here and then looked up by setting.)"""
    from titanloop.train import dry_run as dr

    config = str(REPO / "train_configs/debug.toml")
    base = ["--parallelism.activation_checkpoint", "loop"]
    selective = ["--parallelism.activation_checkpoint", "selective", "--parallelism.ac_kept_loops", "0"]
    settings = [dr._kept(k, 4) for k in range(5)] + [selective]
    made = {}
    for s in settings:
        cfg = load_config(config, [*base, *s], world_size=2)
        made[(cfg.parallelism.activation_checkpoint, cfg.parallelism.ac_kept_loops)] = dry_run(cfg, 2, memory_plan=True)
    peak = {tuple(s): made[(s[1], int(s[3]))].memory_plan.peak / 1e9 for s in settings}
    kept = [peak[tuple(dr._kept(k, 4))] for k in range(5)]
    assert kept == sorted(kept) and len(set(kept)) == 5, kept  # every kept loop holds more: bisection's premise

    def planned(cfg, world_size, memory_plan, gpu_mem_gb):
        report = made[(cfg.parallelism.activation_checkpoint, cfg.parallelism.ac_kept_loops)]
        report.memory_plan.gpu_mem_gb = gpu_mem_gb
        return report

    monkeypatch.setattr(dr, "dry_run", planned)
    limits = sorted({*kept, peak[tuple(selective)]})
    for limit in [kept[0] / 2, *((a + b) / 2 for a, b in zip(limits, limits[1:])), kept[4] * 2]:
        fits = [s for s in settings if peak[tuple(s)] <= limit]
        want = next((s for s in (settings[4], selective) if s in fits), max(fits[:4], default=None, key=settings.index))
        got, plans = dr.fit_activation_checkpointing(config, base, 2, gpu_mem_gb=4 + limit, progress=lambda x: None)
        assert got == want, (limit, got, want)
        assert len(plans) <= (4 + 2 - 1).bit_length() + 1 and all(p["fits"] == (p["peak_gb"] <= limit) for p in plans)
    # a margin of the planned peak kept free turns a just-fitting plan away
    just = 4 + kept[4] * 1.001
    assert dr.fit_activation_checkpointing(config, base, 2, gpu_mem_gb=just, progress=print)[0] == settings[4]
    assert dr.fit_activation_checkpointing(config, base, 2, gpu_mem_gb=just, margin=0.01)[0] != settings[4]


def test_fit_ac_command_line_and_its_bad_input():
    ok = _dry_run_cli("train_configs/debug.toml", "--world-size", "2", "--fit-ac", "--gpu-mem-gb", "1000")
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert ok.stdout.splitlines()[-1] == (
        "least recomputation that fits: --parallelism.activation_checkpoint none --parallelism.ac_kept_loops 0"
    )
    nothing = _dry_run_cli("train_configs/debug.toml", "--world-size", "2", "--fit-ac", "--gpu-mem-gb", "1")
    assert nothing.returncode == 2 and nothing.stderr.count("\n") == 1, nothing.stderr
    assert nothing.stderr.startswith("error: not even per-loop AC without kept loops fits 1.0 GB per GPU")
    bad = _dry_run_cli("train_configs/debug.toml", "--world-size", "2", "--fit-ac", "--fit-margin", "1.5")
    assert bad.returncode == 2 and bad.stderr == (
        "error: --fit-margin=1.5 is invalid: expected a fraction of the planned peak in [0, 1), e.g. 0.1\n"
    )
