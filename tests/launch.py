"""How tests start the trainer: `torchrun -m titanloop.train` (or a test driver script) in a subprocess, the way a
user does, through `python -m torch.distributed.run` with this interpreter.

    from launch import start, train

    run = train(tmp_path / "run", {"training.steps": 4, "metrics.log_freq": 1}, nproc=2)  # waits; asserts exit 0
    run.by_step[4]["loss"], run.stdout, run.out        # metrics.jsonl rows by step; the output
    bad = train(run_dir, {...}, check=False)           # a launch that must fail: bad.returncode, bad.stderr

    job = start(run_dir, {...}, nproc=2)               # in the background, its own session, output to a log file
    job.wait_for_step(3); job.interrupt(signal.SIGUSR1, job.rank_pid(1)); job.finish()

Every launch gets OMP_NUM_THREADS=1, PYTHONUNBUFFERED=1, WANDB_MODE=offline, WANDB_SILENT=true and the repository
first on PYTHONPATH (the workers import this checkout's titanloop); `env` adds to that, a None value removes a
variable. Overrides are a dict, {"section.key": value}, written as TOML literals (experiments.common.override_args).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

from experiments.common import metrics, override_args, torchrun

REPO = Path(__file__).resolve().parents[1]
DEBUG = REPO / "train_configs" / "debug.toml"
TRAINER = ("-m", "titanloop.train")
TAIL = 3000  # characters of output in a failure message
# debug.toml with short sequences and small batches: 2 micro-batches of 2 sequences of 32 tokens per step
SMALL_BATCH = {"training.seq_len": 32, "training.micro_batch_size": 2, "training.global_batch_size": 4}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def environment(extra: Mapping[str, str | None] | None = None) -> dict[str, str]:
    """The environment of a launch (see the module docstring). WANDB_SERVICE is dropped: an in-process W&B test
    earlier in the session leaves its service address there, and a launch would attach to that service."""
    env = {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}
    env.update(
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        WANDB_MODE="offline",
        WANDB_SILENT="true",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    )
    for key, value in (extra or {}).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def trainer_args(config: str | os.PathLike, run_dir: Path | None, overrides: Mapping | None) -> list[str]:
    """`--config C [--training.run_dir D] --section.key value ...`; run_dir None: the config's own run dir."""
    run = {} if run_dir is None else {"training.run_dir": str(run_dir)}
    return ["--config", str(config), *override_args({**run, **(overrides or {})})]


def multinode(nnodes: int, node_rank: int, port: int) -> list[str]:
    """torchrun's rendezvous options for launcher `node_rank` of `nnodes` on this machine (c10d on 127.0.0.1)."""
    return [
        f"--nnodes={nnodes}",
        f"--node_rank={node_rank}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=titanloop-test",
    ]


def _logged(run_dir: Path | None) -> int:
    return len(metrics(run_dir)) if run_dir is not None and (run_dir / "metrics.jsonl").is_file() else 0


def _kill(pid: int) -> None:
    """SIGKILL a launcher and every process under it, and wait for them."""
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=30)


@dataclass
class Finished:
    """A launch that ran to its end: exit code, output, and the metrics.jsonl rows it logged (after those already in
    its run dir)."""

    returncode: int
    stdout: str
    stderr: str
    run_dir: Path | None = None
    skip: int = 0

    @property
    def out(self) -> str:
        return self.stdout + self.stderr

    @property
    def tail(self) -> str:
        return self.stdout[-TAIL:] + self.stderr[-TAIL:]

    @property
    def rows(self) -> list[dict]:
        return metrics(self.run_dir)[self.skip :]

    @property
    def by_step(self) -> dict[int, dict]:
        """step -> its row (the last one, should this launch log a step twice)."""
        return {r["step"]: r for r in self.rows}


def run(
    nproc: int,
    *args: str,
    env: Mapping[str, str | None] | None = None,
    cwd: str | os.PathLike = REPO,
    timeout: float = 600,
    check: bool = True,
    run_dir: Path | None = None,
) -> Finished:
    """`torchrun --standalone --nproc_per_node=nproc ARGS` to its end (ARGS: `-m module ...` or a script and its
    arguments). check: assert exit code 0. A launch still running after `timeout` s is killed with its workers and
    fails the test."""
    skip = _logged(run_dir)
    proc = subprocess.Popen(
        torchrun(nproc, *args), cwd=cwd, env=environment(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill(proc.pid)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"torchrun did not finish in {timeout} s:\n{stdout[-TAIL:]}{stderr[-TAIL:]}") from None
    done = Finished(proc.returncode, stdout, stderr, run_dir, skip)
    assert not check or done.returncode == 0, done.tail
    return done


def train(
    run_dir: Path | None,
    overrides: Mapping | None = None,
    *,
    nproc: int = 2,
    config: str | os.PathLike = DEBUG,
    entry: Sequence[str] = TRAINER,
    **kwargs,
) -> Finished:
    """`torchrun -m titanloop.train --config CONFIG --training.run_dir RUN_DIR OVERRIDES` to its end (run()'s
    keywords: env, cwd, timeout, check). entry: what torchrun starts instead of `-m titanloop.train` (a test driver
    taking the trainer's arguments)."""
    return run(nproc, *entry, *trainer_args(config, run_dir, overrides), run_dir=run_dir, **kwargs)


class Launch:
    """A torchrun launch in the background, in its own session (process group), its output going to `log`.
    torchrun starts each worker in a session of its own."""

    def __init__(
        self,
        nproc: int,
        *args: str,
        log: str | os.PathLike,
        run_dir: Path | None = None,
        env: Mapping[str, str | None] | None = None,
        cwd: str | os.PathLike = REPO,
        rendezvous: list[str] | None = None,
    ):
        self.run_dir, self.log = run_dir, Path(log)
        self.skip = _logged(run_dir)
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                torchrun(nproc, *args, rendezvous=rendezvous),
                cwd=cwd,
                env=environment(env),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    @property
    def out(self) -> str:
        return self.log.read_text()

    def rows(self) -> list[dict]:
        """metrics.jsonl rows this launch has logged so far (complete lines only)."""
        if self.run_dir is None or not (self.run_dir / "metrics.jsonl").is_file():
            return []
        return metrics(self.run_dir)[self.skip :]

    def steps(self) -> list[int]:
        return [r["step"] for r in self.rows()]

    def wait_until(self, ready: Callable[[], object], what: str, timeout: float = 240, poll: float = 0.02):
        """Poll `ready()` until it returns something true (returned); fails if the launch ends first or after
        `timeout` s."""
        deadline = time.time() + timeout
        while not (value := ready()):
            if self.proc.poll() is not None:
                raise AssertionError(f"launch ended (exit {self.proc.returncode}) before {what}:\n{self.out[-TAIL:]}")
            if time.time() > deadline:
                raise AssertionError(f"no {what} after {timeout} s:\n{self.out[-TAIL:]}")
            time.sleep(poll)
        return value

    def wait_for_step(self, step: int, timeout: float = 240) -> None:
        """Until this launch has logged step `step` or a later one."""
        self.wait_until(lambda: any(s >= step for s in self.steps()), f"step {step}", timeout)

    def workers(self) -> list[int]:
        """The launcher's child processes (the ranks)."""
        try:
            return [p.pid for p in psutil.Process(self.proc.pid).children()]
        except psutil.NoSuchProcess:
            return []

    def rank_pid(self, local_rank: int) -> int:
        """The worker process with LOCAL_RANK=local_rank."""
        for pid in self.workers():
            if f"LOCAL_RANK={local_rank}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                return pid
        raise AssertionError(f"no worker with LOCAL_RANK={local_rank}")

    def signal_workers(self, sig: int) -> None:
        """`sig` to every worker (what slurm/launch_node.sh does with a forwarded Slurm signal)."""
        for pid in self.workers():
            os.kill(pid, sig)

    def group(self, sig: int) -> None:
        """`sig` to every process of the launch: torchrun's process group and each worker's."""
        for pid in [self.proc.pid, *self.workers()]:
            try:
                os.killpg(os.getpgid(pid), sig)
            except ProcessLookupError:
                pass

    def interrupt(self, sig: int, pid: int | None = None) -> None:
        """Deliver `sig` (to `pid`, else to the launcher) while every process of the launch is stopped, so where it
        lands does not depend on the machine's speed."""
        self.group(signal.SIGSTOP)
        os.kill(pid or self.proc.pid, sig)
        self.group(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL every process of the launch and wait until they are gone."""
        procs = []
        for pid in [self.proc.pid, *self.workers()]:
            try:
                procs.append(psutil.Process(pid))
            except psutil.NoSuchProcess:
                pass
        self.group(signal.SIGKILL)
        self.proc.wait(timeout=60)
        psutil.wait_procs(procs, timeout=30)

    def finish(self, timeout: float = 300) -> int:
        """Wait for the launch to end; its exit code. Still running after `timeout` s: killed, and the test fails."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"launch did not finish in {timeout} s:\n{self.out[-TAIL:]}") from None


def start(
    run_dir: Path | None,
    overrides: Mapping | None = None,
    *,
    nproc: int = 2,
    config: str | os.PathLike = DEBUG,
    log: str | os.PathLike | None = None,
    **kwargs,
) -> Launch:
    """`torchrun -m titanloop.train ...` as train() does, in the background (Launch's keywords: env, cwd,
    rendezvous). The output goes to `log`, by default <run_dir>/launch-<n>.log (n: the launches before it)."""
    args = trainer_args(config, run_dir, overrides)
    return Launch(nproc, *TRAINER, *args, log=next_log(run_dir) if log is None else log, run_dir=run_dir, **kwargs)


def next_log(run_dir: Path) -> Path:
    """<run_dir>/launch-<n>.log, n: the launches logged there before (run_dir is created)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir / f"launch-{len(list(run_dir.glob('launch-*.log')))}.log"
