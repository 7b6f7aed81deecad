import json
import os
import signal
import sys
import time
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


class _Hostile:
    """A pickled object whose unpickling runs `touch <marker>`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _refresh_manifest(ckpt) -> None:
    """What an attacker does after editing a checkpoint's files: make the manifest's sizes and crc32 match."""
    from titanloop.checkpoint import layout

    manifest = json.loads((ckpt / layout.MANIFEST).read_text())
    manifest["files"] = {
        p.name: layout.file_record(p, True) for p in sorted(ckpt.iterdir()) if p.name != layout.MANIFEST
    }
    (ckpt / layout.MANIFEST).write_text(json.dumps(manifest))


@pytest.fixture
def hostile():
    """Crafting malicious checkpoints: payload(marker) pickles into code that creates `marker`;
    refresh_manifest(step_dir) makes titanloop.json's file records match the edited files."""
    return SimpleNamespace(payload=_Hostile, refresh_manifest=_refresh_manifest)


# ---- no hidden skips under CI ----------------------------------------------------------------------------------
# Under CI=true (.ci/run: moto, lm-eval and a local Slurm cluster are installed and started), a skipped test fails
# the run unless its reason starts with one of these (tests that need, or cannot run on, a CUDA GPU; CI has
# none). Every skip is listed at the end of the run with its reason. Outside CI a skip only prints its reason.
CI_ALLOWED_SKIPS = ("needs a CUDA GPU", "this machine has CUDA")
_skips: list[tuple[str, str]] = []  # (test or module, reason)


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


def _record_skip(report) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        _skips.append((report.nodeid, _skip_reason(report)))


def pytest_runtest_logreport(report):
    _record_skip(report)
    _seconds[report.nodeid.split("::")[0]] += report.duration


# ---- where a stopped run was -------------------------------------------------------------------------------------
# CI stops a run that passes its time limit with SIGTERM; pytest's own summary (--durations) is then never printed,
# and the log ends in progress dots. On SIGTERM this prints one block to stderr: the seconds since the session
# started, the tests that were running, and the test files that took longest so far; then it dies of SIGTERM as
# before. With pytest-xdist (scripts/test.sh) the controller reports, from the workers' reports; the workers keep
# the default action.
_seconds: Counter = Counter()  # test file -> seconds of setup + call + teardown so far
_running = SimpleNamespace(tests={}, started=time.monotonic(), config=None, pid=None)  # tests: running nodeids


def pytest_sessionstart(session):
    _running.started, _running.config, _running.pid = time.monotonic(), session.config, os.getpid()
    is_worker = hasattr(session.config, "workerinput")
    if not is_worker and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:  # a runner's own handler is left alone
        signal.signal(signal.SIGTERM, _report_and_die)


def pytest_runtest_logstart(nodeid, location):
    _running.tests[nodeid] = None


def pytest_runtest_logfinish(nodeid, location):
    _running.tests.pop(nodeid, None)


def _report_and_die(signum, frame):
    # A child forked by a test (a DataLoader or multiprocessing worker) inherits this handler; when its parent
    # terminates it, it dies of SIGTERM without a report: it is not the session that was stopped.
    if os.getpid() == _running.pid:
        _report()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _report():
    top = ", ".join(f"{f} {s:.0f} s" for f, s in _seconds.most_common(10))
    capture = _running.config.pluginmanager.getplugin("capturemanager") if _running.config else None
    if capture is not None:  # the test's output capture holds stderr: give the real one back first
        capture.suspend_global_capture(in_=True)
    sys.stderr.write(
        f"\n[tests] SIGTERM after {time.monotonic() - _running.started:.0f} s, during "
        f"{', '.join(_running.tests) or 'no test'}\n"
        f"[tests] slowest test files so far: {top or 'none finished'}\n"
    )
    sys.stderr.flush()


def pytest_collectreport(report):  # module-level skips (pytest.importorskip, allow_module_level)
    _record_skip(report)


def _disallowed() -> list[tuple[str, str]]:
    return [(n, r) for n, r in _skips if not r.startswith(CI_ALLOWED_SKIPS)]


def pytest_sessionfinish(session, exitstatus):
    if _in_ci() and _disallowed() and exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not _skips:
        return
    bad = _disallowed()
    terminalreporter.section("skips")
    for nodeid, reason in _skips:
        tag = (
            "allowed in CI (GPU-only)"
            if (nodeid, reason) not in bad
            else "FAILS THE RUN (CI=true)"
            if _in_ci()
            else "would fail under CI=true"
        )
        terminalreporter.write_line(f"{tag}: {nodeid}: {reason}")
    if _in_ci() and bad:
        terminalreporter.write_line(
            f"CI=true: {len(bad)} skip(s) whose reason is not on CI_ALLOWED_SKIPS (tests/conftest.py) fail the run",
            red=True,
        )
