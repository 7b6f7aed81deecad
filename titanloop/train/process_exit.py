"""How a finished training process leaves: flush, then `os._exit` without the interpreter's teardown.

Native threads of gloo, DeepSpeed or MKL that outlive main() can abort the teardown of a run that has already
saved, flushed and closed everything (SIGABRT, "terminate called without an active exception"); torchrun and
Slurm would report that as a failed job. Seen in CI on `titanloop.train` workers and on a DeepSpeed test driver.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn


def exit_without_teardown(code: int) -> NoReturn:
    """Flush stdout/stderr and end the process with `code`; call it only once everything is saved and closed."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
