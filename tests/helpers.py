"""What several test files share besides launching (tests/launch.py): comparing a resumed run with an uninterrupted
one bit for bit, loading a script (scripts/, not a package) as a module, and an environment where a shell script's
setup cannot run."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from titanloop.checkpoint import layout
from titanloop.checkpoint.safe_reader import read_dcp_entries

from launch import metrics


def load_script(path: Path, name: str):
    """The script at `path` executed as a module named `name` (not registered in sys.modules)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def no_setup_env(tmp_path: Path) -> dict[str, str]:
    """An environment whose setup (scripts/setup.sh) cannot run: no venv at TITANLOOP_VENV, and a python3 in tmp_path
    that cannot make one, so a script that reaches setup fails fast (exit 1) instead of installing ~6 GB."""
    (tmp_path / "python3").write_text("#!/bin/sh\nexit 1\n")
    (tmp_path / "python3").chmod(0o755)
    env = {**os.environ, "TITANLOOP_VENV": str(tmp_path / "venv"), "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    env.pop("PYTHON", None)
    return env


TIMING_KEYS = {"tokens_per_s", "tflops", "mfu"}  # wall-clock figures (and time/...): not expected to repeat


def history(run_dir: Path) -> dict[int, list[dict]]:
    """step -> every record logged for it (a step re-run after a fallback is logged again), timings removed."""
    out: dict[int, list[dict]] = {}
    for row in metrics(run_dir):
        rec = {k: v for k, v in row.items() if k not in TIMING_KEYS and not k.startswith("time/")}
        out.setdefault(rec["step"], []).append(rec)
    return out


def final_state(run_dir: Path, step: int) -> tuple[dict, dict]:
    """(every DCP entry, the JSON states) of the run's checkpoint of `step`."""
    ckpt = run_dir / "checkpoints" / layout.step_dir_name(step)
    return read_dcp_entries(ckpt), layout.read_manifest(ckpt)["states"]


def assert_same_checkpoint(got_dir: Path, ref_dir: Path, step: int) -> None:
    """The two runs' checkpoints of `step`: every tensor bit for bit (model and optimizer among them) and the JSON
    states."""
    (got, got_states), (ref, ref_states) = final_state(got_dir, step), final_state(ref_dir, step)
    assert got.keys() == ref.keys()
    assert any(k.startswith("model/") for k in ref) and any(k.startswith("optimizer/") for k in ref)
    different = [k for k in ref if got[k].numpy().tobytes() != ref[k].numpy().tobytes()]  # bits (NaN == NaN)
    assert not different, f"{len(different)} tensors differ from the reference run, e.g. {different[:3]}"
    assert got_states == ref_states  # LR schedule, data loader position, step/token counters


def assert_bitwise_same_run(got_dir: Path, ref_dir: Path, steps: int) -> None:
    """Two runs of `steps` steps: the final checkpoints (assert_same_checkpoint) and every logged step's record
    (each of a step logged again after a fallback), timings aside."""
    assert_same_checkpoint(got_dir, ref_dir, steps)
    got_h, ref_h = history(got_dir), history(ref_dir)
    assert sorted(got_h) == sorted(ref_h) == list(range(1, steps + 1))
    for step, records in got_h.items():
        assert all(r == ref_h[step][0] for r in records), (step, records, ref_h[step][0])


def logged_step(cfg, n_loops: int, per_loop: dict, tokens_per_row: int = 16, seconds: float = 0.5) -> dict:
    """The metrics.jsonl row the trainer's Metrics callback writes for one step of `cfg` (its run_dir) that ran
    `n_loops` loops over `tokens_per_row` rows in `seconds`, with the objective's per-loop statistics `per_loop`."""
    import json
    from types import SimpleNamespace

    from titanloop.train.callbacks import Metrics, StepResult

    run = SimpleNamespace(
        cfg=cfg,
        mesh=SimpleNamespace(device_type="cpu", world_size=1, rank=0),
        dataloader=SimpleNamespace(batch_at=lambda i: tokens_per_row),
        state=SimpleNamespace(skipped_steps=0),
    )
    cb = Metrics(run)
    result = StepResult(step=1, n_loops=n_loops, loss=1.0, per_loop=per_loop, lr=1e-3, seconds=seconds, grad_norm=1.0)
    cb.post_step(run, result)
    cb.close()
    return json.loads((Path(cfg.training.run_dir) / "metrics.jsonl").read_text().splitlines()[-1])
