"""tests/conftest.py's skip policy: under CI=true a skip whose reason is not on CI_ALLOWED_SKIPS fails the run
(exit 1), an allow-listed one does not; every skip is listed at the end with its reason, in CI or not."""

import os
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


def run_pytest(tmp_path: Path, reason: str, ci: str | None, module_level: bool = False):
    shutil.copy(HERE / "conftest.py", tmp_path / "conftest.py")
    if module_level:
        body = (
            f'import pytest\npytest.importorskip("no_such_module_xyz", reason="{reason}")\n\ndef test_x():\n    pass\n'
        )
    else:
        body = SAMPLE.format(kind="one", reason=reason)
    (tmp_path / "test_sample.py").write_text(body)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
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
