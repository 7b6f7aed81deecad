"""The README's first command, scripts/demo.sh (real text): its summary step, its flags, and (slow) the whole
pipeline at a few steps. README.md quotes a recorded full run (experiments/demo_recorded/real_text.txt)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def demo(*args: str, timeout: int = 60) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "scripts/demo.sh", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def fake_run(root: Path, model: str, losses: list[float], loops: list[int] | None = None) -> None:
    (root / model).mkdir(parents=True)
    val = {f"val/loss/loop_{t}": v for t, v in zip(loops or range(1, len(losses) + 1), losses)} | {"val/tokens": 111488}
    rows = [{"step": 1, "loss": 4.0}, {"step": 2000, "loss": 1.5, **val}]
    (root / model / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_summary_reads_the_last_validation_of_each_model(tmp_path):
    fake_run(tmp_path, "looped", [3.0, 2.2, 1.9, 1.8, 1.85, 1.9, 2.0, 2.1])
    fake_run(tmp_path, "once", [2.0, 2.5, 3.0, 3.5, 4.0, 4.2, 4.3, 4.4])
    fake_run(tmp_path, "dense", [1.6, 2.7, 3.8, 4.1, 4.0, 4.0, 4.1, 4.1])
    proc = subprocess.run(
        [sys.executable, "scripts/demo_text_summary.py", str(tmp_path)], cwd=REPO, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["gap_closed"] == pytest.approx((2.0 - 1.8) / (2.0 - 1.6))
    assert s["loss_at_max_minus_trained"] == pytest.approx(2.1 - 1.8) and s["tokens"] == 111488
    assert "50% of the way" in proc.stdout and "T = 8: +0.300 (worse)" in proc.stdout
    (tmp_path / "dense" / "metrics.jsonl").unlink()
    missing = subprocess.run(
        [sys.executable, "scripts/demo_text_summary.py", str(tmp_path)], cwd=REPO, capture_output=True, text=True
    )
    assert missing.returncode != 0 and "dense/metrics.jsonl is missing" in missing.stderr


def test_summary_shows_the_looped_model_to_t32_beside_models_scored_to_8(tmp_path):
    deep = [1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32]
    fake_run(tmp_path, "looped", [3.0, 2.2, 1.9, 1.8, 1.79, 1.8, 1.8, 1.81, 1.83, 1.85, 1.9, 1.95], deep)
    fake_run(tmp_path, "once", [2.0, 2.5, 3.0, 3.5, 4.0, 4.2, 4.3, 4.4])
    fake_run(tmp_path, "dense", [1.6, 2.7, 3.8, 4.1, 4.0, 4.0, 4.1, 4.1])
    proc = subprocess.run(
        [sys.executable, "scripts/demo_text_summary.py", str(tmp_path)], cwd=REPO, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["loops"] == deep and s["heldout"]["once"][-4:] == [None] * 4
    assert s["past_trained"]["16"] == pytest.approx(0.05) and s["past_trained"]["32"] == pytest.approx(0.15)
    assert s["loss_at_max_minus_trained"] == pytest.approx(0.15)
    assert "T = 16: +0.050 (worse)" in proc.stdout and "T = 32: +0.150 (worse)" in proc.stdout
    assert "T = 5: -0.010 (better)" in proc.stdout and "T = 6: +0.000 (same)" in proc.stdout
    assert "\n    32 |                  1.950   |                      -   |" in proc.stdout  # '-': not scored at 32
    bad = subprocess.run(
        [sys.executable, "scripts/demo_text_summary.py", str(tmp_path), "--trained-loops", "10"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert bad.returncode != 0 and "not scored at its trained T = 10" in bad.stderr


def test_demo_help_and_bad_flags_touch_nothing(tmp_path):
    (tmp_path / "notes.txt").write_text("keep me")
    help_ = demo("--help")
    assert (
        help_.returncode == 0 and help_.stdout.startswith("usage: bash scripts/demo.sh") and "--compose" in help_.stdout
    )
    assert "[setup]" not in help_.stdout
    bad = demo("--seed", "x")
    assert bad.returncode == 2 and "--seed 'x' is invalid" in bad.stderr
    foreign = demo("--out", str(tmp_path))
    assert foreign.returncode == 2 and "holds no demo run" in foreign.stderr
    assert (tmp_path / "notes.txt").read_text() == "keep me"
    compose = demo("--compose", "--help")  # the composition demo is one flag away
    assert compose.returncode == 0 and compose.stdout.startswith("usage: bash scripts/demo_compose.sh")


@pytest.mark.slow
def test_demo_trains_scores_and_samples_on_real_text(tmp_path):
    """The whole README command at 30 steps: three models trained, each scored on the whole held-out split at
    T = 1..8 (the looped model also at 12, 16, 24 and 32), the summary written, and a text sample printed."""
    out = tmp_path / "demo"
    proc = demo("--out", str(out), "--training.steps", "30", timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["loops"] == [*range(1, 9), 12, 16, 24, 32] and s["tokens"] == (111541 - 1) // 64 * 64
    assert all(x is not None for x in s["heldout"]["looped"]) and set(s["past_trained"]) == {
        "5",
        "6",
        "7",
        "8",
        "12",
        "16",
        "24",
        "32",
    }
    assert all(all(x is not None for x in v[:8]) for v in s["heldout"].values())
    assert "\nROMEO:" in proc.stdout and "held-out loss" in proc.stdout.lower() and "by loop T" in proc.stdout
