"""tests/conftest.py's skip policy: under CI=true a skip whose reason is not on CI_ALLOWED_SKIPS fails the run
(exit 1), an allow-listed one does not; every skip is listed at the end with its reason, in CI or not."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

SAMPLE = """
import pytest

def test_passes():
    pass

def test_skipped_{kind}():
    pytest.skip("{reason}")
"""


def sample_session(tmp_path: Path, files: dict[str, str]) -> list[str]:
    """tmp_path holds this conftest and `files` (name -> source); the pytest command that runs them there."""
    shutil.copy(HERE / "conftest.py", tmp_path / "conftest.py")
    for name, source in files.items():
        (tmp_path / name).write_text(source)
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)]


def run_pytest(tmp_path: Path, reason: str, ci: str | None, module_level: bool = False):
    if module_level:
        body = (
            f'import pytest\npytest.importorskip("no_such_module_xyz", reason="{reason}")\n\ndef test_x():\n    pass\n'
        )
    else:
        body = SAMPLE.format(kind="one", reason=reason)
    command = sample_session(tmp_path, {"test_sample.py": body})
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    return subprocess.run(
        command,
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("module_level", [False, True])
def test_unlisted_skip_fails_the_run_under_ci(tmp_path, module_level):
    proc = run_pytest(tmp_path, "moto S3 server could not start", "true", module_level)
    assert proc.returncode == 1, proc.stdout[-2000:]
    assert "FAILS THE RUN (CI=true)" in proc.stdout and "moto S3 server could not start" in proc.stdout


def test_unlisted_skip_outside_ci_only_prints_its_reason(tmp_path):
    proc = run_pytest(tmp_path, "moto S3 server could not start", None)
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert "would fail under CI=true" in proc.stdout and "moto S3 server could not start" in proc.stdout


def test_gpu_only_skip_is_allowed_and_listed_under_ci(tmp_path):
    proc = run_pytest(tmp_path, "needs a CUDA GPU: flash attention", "true")
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert "allowed in CI (GPU-only)" in proc.stdout and "needs a CUDA GPU: flash attention" in proc.stdout


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has CUDA: the GPU tests would run")
def test_the_gpu_tests_skip_as_ci_allows_without_a_gpu(tmp_path):
    """tests/test_gpu.py (marker gpu) under CI=true on a machine without CUDA: every GPU test skips with an allowed
    reason and the run passes; the same file with another skip reason fails the run."""
    source = (HERE / "test_gpu.py").read_text()
    env = {**{k: v for k, v in os.environ.items() if k != "CI"}, "CI": "true", "PYTHONPATH": str(HERE.parent)}
    for reason, code in (("needs a CUDA GPU:", 0), ("no GPU here:", 1)):
        command = sample_session(
            tmp_path, {"test_gpu.py": source.replace('reason="needs a CUDA GPU:', f'reason="{reason}')}
        )
        proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == code, (reason, proc.stdout[-2000:])
        tag = "allowed in CI (GPU-only): " if code == 0 else "FAILS THE RUN (CI=true): "
        skipped = int(re.search(r"(\d+) skipped", proc.stdout)[1])
        assert proc.stdout.count(tag) == skipped and skipped >= 10, proc.stdout[-2000:]  # every GPU test


@pytest.mark.parametrize("runner", [["-p", "no:xdist"], ["-n", "2", "--dist", "loadfile"]], ids=["serial", "xdist"])
def test_a_run_stopped_by_sigterm_says_where_it_was(tmp_path, runner):
    """CI stops a run past its limit with SIGTERM, before pytest prints any durations: the run then names the test it
    was in, its elapsed time and the slowest files so far, and still dies of SIGTERM (exit status unchanged). With
    two xdist workers (scripts/test.sh) the controller reports once (the workers, signalled too, do not), and no
    worker is left running."""
    import signal
    import time

    import psutil

    command = sample_session(
        tmp_path,
        {
            "test_first.py": "import pathlib, time\n\ndef test_warm():\n"
            "    time.sleep(0.3)\n    pathlib.Path('warm').touch()\n",
            "test_second.py": "import pathlib, time\n\ndef test_hangs():\n"
            "    while not pathlib.Path('warm').exists():\n        time.sleep(0.05)\n"
            "    pathlib.Path('started').touch()\n    time.sleep(120)\n",
        },
    )
    proc = subprocess.Popen(
        [*command, *runner],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while not (tmp_path / "started").exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    time.sleep(2)  # test_warm's report reaches the xdist controller
    workers = psutil.Process(proc.pid).children(recursive=True)
    os.killpg(proc.pid, signal.SIGTERM)  # the whole process group, as a runner stopping a job does
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGTERM, (proc.returncode, out[-2000:], err[-2000:])
    assert err.count("[tests] SIGTERM after") == 1, err[-2000:]
    assert "during test_second.py::test_hangs\n" in err, err[-2000:]
    assert "slowest test files so far: test_first.py 0 s" in err, err[-2000:]
    gone, alive = psutil.wait_procs(workers, timeout=30)
    for p in alive:
        p.kill()
    assert not alive, [p.cmdline() for p in alive]


def test_a_forked_child_terminated_by_its_test_reports_nothing(tmp_path):
    """A DataLoader or multiprocessing worker forked by a test inherits the SIGTERM handler; when the test terminates
    it (a DataLoader does, when a worker is slow to exit), the child dies of SIGTERM quietly: the report is only for
    the session that was stopped, and naming a test that goes on to pass would mislead."""
    command = sample_session(
        tmp_path,
        {
            "test_fork.py": "import multiprocessing, signal, time\n\n"
            "def test_terminates_a_child():\n"
            "    child = multiprocessing.get_context('fork').Process(target=time.sleep, args=(60,))\n"
            "    child.start()\n"
            "    time.sleep(0.5)\n"
            "    child.terminate()\n"
            "    child.join(30)\n"
            "    assert child.exitcode == -signal.SIGTERM\n"
        },
    )
    proc = subprocess.run(
        command,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "SIGTERM after" not in proc.stdout + proc.stderr, proc.stderr[-2000:]
