"""The one builder of torchrun command lines: the acceptance checks (titanloop.checks), the benchmarks, the
experiments (experiments.common) and the tests (tests/launch.py) all start their runs through it."""

from __future__ import annotations

import sys


def torchrun(nproc: int, *args: str, python: str | None = None, rendezvous: list[str] | None = None) -> list[str]:
    """`python -m torch.distributed.run --standalone --nproc_per_node=nproc ARGS` (ARGS: `-m module ...` or a script
    and its arguments), with `python` (default: this interpreter). `rendezvous` replaces --standalone with other
    torchrun options, e.g. ["--nnodes=2", "--node_rank=0", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:29400"]."""
    return [
        python or sys.executable,
        "-m",
        "torch.distributed.run",
        *(["--standalone"] if rendezvous is None else rendezvous),
        f"--nproc_per_node={nproc}",
        *args,
    ]
