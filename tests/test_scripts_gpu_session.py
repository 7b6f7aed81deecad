"""scripts/gpu_session.py, the one GPU call for issues 34-36, without a GPU: its parts and budgets, the usage
errors, installing the wheels the GPU machine lacks, stopping a part past its time, what goes into logs.tar.gz, and
one real call at smoke size (the check part) that leaves its json, session.json and the logs in --out."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import pytest

from helpers import load_script

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_session.py"
gs = load_script(SCRIPT, "gpu_session_script")
HEAD = "0123456789abcdef0123456789abcdef01234567"


def test_parts_and_their_budgets():
    assert gs.parse_parts("check:240,eval") == [("check", 240.0), ("eval", None)]
    assert gs.parse_parts(gs.DEFAULT_PARTS) == [("check", 340.0), ("throughput", None)]
    for bad, says in (
        ("check,foo", "unknown part 'foo'"),
        ("check,check", "given twice"),
        ("eval:x", "must be a number"),
        ("eval:0", "must be > 0"),
    ):
        with pytest.raises(ValueError, match=says):
            gs.parse_parts(bad)
    assert gs.part_budget(None, 300.0, 3) == 100.0  # an equal share of what is left
    assert gs.part_budget(240.0, 300.0, 3) == 240.0  # what it was given
    assert gs.part_budget(240.0, 100.0, 1) == 100.0  # never more than is left
    assert gs.part_budget(None, -5.0, 2) == 0.0


def _wheel(folder: Path, name: str) -> Path:
    """A minimal pure-Python wheel holding one empty package `name`."""
    path = folder / f"{name}-1.0-py3-none-any.whl"
    info = f"{name}-1.0.dist-info"
    files = {
        f"{name}/__init__.py": "",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{f},,\n" for f in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(path, "w") as z:
        for f, text in files.items():
            z.writestr(f, text)
    return path


def test_wheels_installed_only_when_torchtitan_or_torchao_is_missing(tmp_path, monkeypatch):
    """The first thing a GPU call does (the GPU machine lacks torchtitan and torchao): pip installs .whl/*.whl
    into the site folder, offline, with the flags of shared/GPU.md. Checked here with a real pip and a small wheel;
    with both modules importable, or with no wheels, it installs nothing and says why."""
    (tmp_path / ".whl").mkdir()
    site = tmp_path / "site"
    monkeypatch.setattr(gs, "ROOT", tmp_path)
    monkeypatch.setattr(gs, "SITE", site)
    assert gs.install_wheels(sys.executable) == "wheels: not needed (torchtitan and torchao import)"
    real = importlib.util.find_spec
    monkeypatch.setattr(gs.importlib.util, "find_spec", lambda m: None if m == "torchao" else real(m))
    assert gs.install_wheels(sys.executable) == (
        "wheels: ['torchao'] missing and no .whl/*.whl here (shared/GPU.md says how to bring them)"
    )
    _wheel(tmp_path / ".whl", "titanloop_fake_wheel")
    assert gs.install_wheels(sys.executable) == f"wheels: 1 installed into {site}"
    assert (site / "titanloop_fake_wheel" / "__init__.py").is_file()


def test_usage_errors_are_one_line_and_exit_2(tmp_path):
    for args, says in (
        (["--parts", "check,foo"], "--parts: unknown part 'foo'"),
        (["--out", str(tmp_path), "--commit", "abc"], "--commit 'abc': expected a full 40-digit hash"),
        (["--out", str(tmp_path), "--budget-s", "0"], "--budget-s 0: expected seconds > 0"),
        ([], "--out is required"),
    ):
        proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and says in proc.stderr.splitlines()[-1], proc.stderr
    assert not any(tmp_path.iterdir())  # nothing written


def test_part_commands_pass_budget_commit_and_plans(tmp_path):
    plans = tmp_path / "plans.json"
    plans.write_text("{}")
    a = gs.parse_args(["--out", str(tmp_path), "--commit", HEAD, "--plan-json", str(plans), "--check-args=--learning"])
    check = gs.part_command("check", a, 240.4, tmp_path / "w")
    assert check[1] == str(ROOT / "scripts" / "gpu_check.py")
    assert check[2:8] == ["--out", str(tmp_path / "gpu_check.json"), "--budget-s", "240", "--commit", HEAD]
    assert check[8:] == ["--workdir", str(tmp_path / "w" / "check"), "--learning", "--plan-json", str(plans)]
    default = gs.part_command("check", gs.parse_args(["--out", str(tmp_path)]), 300, tmp_path / "w")
    assert default[-2:] == ["--steps", "40"] if not (ROOT / "plans.json").is_file() else "--plan-json" in default
    smoke = gs.part_command("check", gs.parse_args(["--out", str(tmp_path), "--smoke"]), 300, tmp_path / "w")
    assert smoke[-3:] == ["--smoke", "--workdir", str(tmp_path / "w" / "check")]  # its own tiny sizes
    tp = gs.part_command("throughput", a, 100, tmp_path / "w")
    assert tp[1].endswith("benchmarks/gpu_throughput.py") and tp[-2:] == [
        "--artifacts",
        str(tmp_path / "w" / "throughput"),
    ]
    ev = gs.part_command("eval", a, 100, tmp_path / "w")
    assert ev[1].endswith("scripts/gpu_eval_check.py") and "--smoke" not in ev
    more = gs.parse_args(
        ["--out", str(tmp_path), "--throughput-args=--setting 2:loop:tensorwise", "--eval-args=--tokens 9"]
    )
    assert gs.part_command("throughput", more, 100, tmp_path)[-2:] == ["--setting", "2:loop:tensorwise"]
    assert gs.part_command("eval", more, 100, tmp_path)[-2:] == ["--tokens", "9"]


def test_write_plans_uses_the_check_parts_options(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(gs.subprocess, "run", lambda cmd, **kw: seen.append(cmd) or subprocess.CompletedProcess(cmd, 0))
    assert gs.main(["--write-plans", str(tmp_path / "p.json"), "--check-args", "--steps 40 --learning"]) == 0
    assert seen[0][1:] == [str(ROOT / "scripts" / "gpu_check.py"), "--write-plans", str(tmp_path / "p.json")] + [
        "--steps",
        "40",
        "--learning",
    ]


def test_a_part_past_its_time_is_stopped(tmp_path):
    log = tmp_path / "p.log"
    t0 = time.monotonic()
    code = gs.run_part(["bash", "-c", "echo begun; sleep 60"], log, 2.0, {"PATH": "/usr/bin:/bin"})
    assert code is None and time.monotonic() - t0 < 20 and log.read_text() == "begun\n"
    assert gs.run_part(["bash", "-c", "echo ok; exit 4"], log, 30.0, {"PATH": "/usr/bin:/bin"}) == 4


def _ended(pid: int, within_s: float = 10.0) -> bool:
    """Whether process `pid` is gone (or a zombie waiting to be reaped) within `within_s` seconds."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z"):
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


def test_a_stopped_part_stops_the_run_it_waits_on(tmp_path):
    """A part waits on its run in the run's own process group (start_new_session: torchrun and its workers), out
    of reach of a signal to the part's group. Stopping the part at its time must still stop that run: it would
    otherwise hold the GPU through the next part. SIGKILL to the part's group alone (before gpu_procs) left it."""
    pid_file = tmp_path / "run.pid"
    part = (
        "import subprocess, sys; sys.path.insert(0, sys.argv[1]); import gpu_procs; gpu_procs.exit_on_sigterm(); "
        "run = subprocess.Popen(['bash', '-c', 'sleep 120 & echo $! > ' + sys.argv[2] + '; wait'], "
        "start_new_session=True); print('begun', flush=True); gpu_procs.wait_or_stop(run, 600)"
    )
    cmd = [sys.executable, "-c", part, str(ROOT / "scripts"), str(pid_file)]
    t0 = time.monotonic()
    assert gs.run_part(cmd, tmp_path / "p.log", 3.0, {"PATH": "/usr/bin:/bin"}) is None
    assert time.monotonic() - t0 < 30 and (tmp_path / "p.log").read_text().startswith("begun")
    assert _ended(int(pid_file.read_text())), "the part's run outlived the part"


def test_logs_tarball_keeps_logs_not_checkpoints(tmp_path):
    work = tmp_path / "w"
    (work / "check" / "T4-bf16-loop").mkdir(parents=True)
    (work / "check" / "T4-bf16-loop.log").write_text("x")
    (work / "check" / "T4-bf16-loop" / "metrics.jsonl").write_text("{}")
    (work / "eval" / "ckpt").mkdir(parents=True)
    (work / "eval" / "ckpt" / "__0_0.distcp").write_bytes(b"0" * 100)
    (work / "throughput").mkdir()
    (work / "throughput" / "big.log").write_bytes(b"0" * (gs.MAX_LOG_BYTES + 1))
    assert gs.pack_logs(work, tmp_path / "logs.tar.gz") == (2, [])
    with tarfile.open(tmp_path / "logs.tar.gz") as tar:
        assert sorted(tar.getnames()) == ["check/T4-bf16-loop.log", "check/T4-bf16-loop/metrics.jsonl"]


def test_logs_tarball_stays_under_what_the_device_tool_brings_back(tmp_path):
    """A tarball over 16 MiB would not come back at all: the files that compress largest are left out, and named."""
    work = tmp_path / "w"
    run = work / "throughput" / "01-matrix" / "profiles" / "step_9"
    run.mkdir(parents=True)
    (work / "throughput" / "01-matrix.log").write_text("step 1 | loss 10.9\n" * 1000)  # compresses to little
    (work / "throughput" / "gpu_throughput_trace_01-matrix.json.gz").write_bytes(os.urandom(200_000))
    (run / "rank0_trace.json").write_bytes(os.urandom(250_000))  # the profiler's raw trace: the largest
    n, left_out = gs.pack_logs(work, tmp_path / "logs.tar.gz", cap=300_000)
    assert n == 2 and left_out == ["throughput/01-matrix/profiles/step_9/rank0_trace.json (0.2 MiB gzipped)"]
    assert (tmp_path / "logs.tar.gz").stat().st_size <= 300_000
    with tarfile.open(tmp_path / "logs.tar.gz") as tar:
        assert sorted(tar.getnames()) == [
            "throughput/01-matrix.log",
            "throughput/gpu_throughput_trace_01-matrix.json.gz",
        ]
    assert gs.TARBALL_CAP < 16 * 2**20


@pytest.mark.slow
def test_one_smoke_call_leaves_its_results_in_out(tmp_path):
    """The check part at smoke size on CPU (kernel choice only: a compiled torchrun run): --out receives the part's
    json, session.json with its command and exit code, and logs.tar.gz with the part's output and run log."""
    out = tmp_path / "out"
    cmd = [sys.executable, str(SCRIPT), "--smoke", "--out", str(out), "--commit", HEAD, "--parts", "check"]
    proc = subprocess.run(cmd + ["--check-args=--skip-train"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]  # the CUDA kernel rule fails on CPU
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.json", "logs.tar.gz", "session.json"]
    session = json.loads((out / "session.json").read_text())
    (part,) = session["parts"]
    assert part["part"] == "check" and part["exit"] == 1
    assert gs.DEFAULT_BUDGET_S - gs.RESERVE_S - 5 <= part["budget_s"] <= gs.DEFAULT_BUDGET_S - gs.RESERVE_S
    assert "--skip-train" in part["command"] and session["commit"] == HEAD
    doc = json.loads((out / "gpu_check.json").read_text())
    assert doc["commit"] == HEAD and [c["name"] for c in doc["result"]["checks"]] == ["kernel choice"]
    with tarfile.open(out / "logs.tar.gz") as tar:
        assert {"check.log", "check/kernels.log", "check/kernels.json"} <= set(tar.getnames())
    assert "gpu_session: check ended: exit 1" in proc.stdout
