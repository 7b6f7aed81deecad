"""Run nanoGPT's train.py as published, timing the parts of each iteration (the whole-step profile of its loop).

    python benchmarks/nanogpt_step_profile.py PROFILE.jsonl SEED <nanoGPT>/train.py <its arguments ...>

Nothing of nanoGPT is edited or copied: its train.py is read, compiled and run as `__main__` in this process (as
`python train.py ...` would), with its `get_batch` and `estimate_loss` wrapped in timers (a decorator added to the
parsed source before compiling it), and these timed from outside:

  forward     its model.py's `GPT.forward` (the training step's; inside an evaluation it counts as `eval`)
  backward    `torch.Tensor.backward`
  clip        `torch.nn.utils.clip_grad_norm_`
  optimizer   the optimizer's step (torch's global optimizer step hooks)
  zero_grad   `torch.optim.Optimizer.zero_grad`; its return ends an iteration, where train.py reads its clock
  checkpoint  `torch.save`
  data        `get_batch` (train.py's prefetch of the next batch)
  eval        `estimate_loss` (its batches and forwards included)

An iteration runs from the end of the previous one (the first: from the end of the first `get_batch`, where
train.py starts its clock) to the return of its `zero_grad`: the scope of train.py's own printed `time`, which
includes the previous iteration's log line and the evaluation at its start. What no part covers (the learning-rate
update, the log line, interpreter glue) is `uncovered`. `torch.manual_seed(s)` becomes `torch.manual_seed(s +
SEED)` (train.py fixes its seed at 1337 and has no option for it), so run i trains with seed 1337 + i.

PROFILE.jsonl gets, at exit, a `{"startup": {"process": s}}` row (the process's age at the first iteration's start,
from /proc, as titanloop's start-up row measures it) and one row per iteration: `{"step", "wall_s", "parts"}`.
"""

from __future__ import annotations

import ast
import atexit
import json
import os
import sys
import time
from pathlib import Path

PARTS = ["data", "forward", "backward", "clip", "optimizer", "zero_grad", "eval", "checkpoint"]


def process_age() -> float | None:
    """Seconds since this process started (/proc/self/stat; 10 ms resolution), None off Linux."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class Profile:
    """Per-iteration part times; a part entered inside another counts as the outer one."""

    def __init__(self):
        self.rows: list[dict] = []
        self.startup: dict = {}
        self.parts = dict.fromkeys(PARTS, 0.0)
        self.current: str | None = None
        self.entered = 0.0
        self.started: float | None = None  # the current iteration's start

    def enter(self, part: str) -> bool:
        if self.current is not None:
            return False
        self.current, self.entered = part, time.perf_counter()
        return True

    def leave(self) -> None:
        now = time.perf_counter()
        part, self.current = self.current, None
        self.parts[part] += now - self.entered
        if part == "data" and self.started is None:  # the batch before the loop: train.py starts its clock here
            self.startup = {"process": process_age()}
            self.started, self.parts = now, dict.fromkeys(PARTS, 0.0)
        elif part == "zero_grad" and self.started is not None:
            self.rows.append({"step": len(self.rows) + 1, "wall_s": now - self.started, "parts": self.parts})
            self.started, self.parts = now, dict.fromkeys(PARTS, 0.0)

    def timed(self, part: str, fn=None):
        """`fn` timed as `part`; without `fn`, a decorator that does so."""
        if fn is None:
            return lambda f: self.timed(part, f)

        def wrapper(*args, **kwargs):
            if not self.enter(part):
                return fn(*args, **kwargs)
            try:
                return fn(*args, **kwargs)
            finally:
                self.leave()

        wrapper.__wrapped__ = fn
        return wrapper

    def write(self, path: str) -> None:
        with open(path, "w") as f:
            f.write(json.dumps({"startup": self.startup}) + "\n")
            for row in self.rows:
                f.write(json.dumps(row) + "\n")


class _Decorate(ast.NodeTransformer):
    """Adds `@__bench_timed__(part)` to every function named get_batch / estimate_loss (module level or method)."""

    NAMES = {"get_batch": "data", "estimate_loss": "eval"}

    def visit_FunctionDef(self, node):
        self.generic_visit(node)
        if node.name in self.NAMES:
            call = ast.Call(ast.Name("__bench_timed__", ast.Load()), [ast.Constant(self.NAMES[node.name])], [])
            node.decorator_list.insert(0, call)  # outermost: an evaluation's no_grad is inside the timer
        return node


def main(argv: list[str]) -> None:
    if len(argv) < 3:
        raise SystemExit("usage: python benchmarks/nanogpt_step_profile.py PROFILE.jsonl SEED TRAIN_PY [ARGS ...]")
    out, seed, train_py, *rest = argv
    train_py = str(Path(train_py).resolve())
    prof = Profile()
    atexit.register(prof.write, out)

    import torch

    sys.path.insert(0, str(Path(train_py).parent))  # as `python train.py`: its directory first on the path
    import model  # nanoGPT's model.py, the module train.py imports GPT from

    model.GPT.forward = prof.timed("forward", model.GPT.forward)
    torch.Tensor.backward = prof.timed("backward", torch.Tensor.backward)
    torch.nn.utils.clip_grad_norm_ = prof.timed("clip", torch.nn.utils.clip_grad_norm_)
    torch.optim.Optimizer.zero_grad = prof.timed("zero_grad", torch.optim.Optimizer.zero_grad)
    torch.save = prof.timed("checkpoint", torch.save)
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(lambda *a: prof.enter("optimizer") and None)
    register_optimizer_step_post_hook(lambda *a: prof.leave() if prof.current == "optimizer" else None)
    manual_seed = torch.manual_seed
    torch.manual_seed = lambda s: manual_seed(s + int(seed))

    tree = _Decorate().visit(ast.parse(Path(train_py).read_text(), train_py))
    code = compile(ast.fix_missing_locations(tree), train_py, "exec")
    sys.argv = [train_py, *rest]
    exec(
        code,
        {"__name__": "__main__", "__file__": train_py, "__builtins__": __builtins__, "__bench_timed__": prof.timed},
    )


if __name__ == "__main__":
    main(sys.argv[1:])
