"""Evaluation and inference for looped LMs: depth sweeps, early-exit frontiers, per-loop diagnostics, plots,
KV-cache generation and an lm-eval-harness adapter. See docs/eval.md; CLI: `python -m titanloop.eval --help`.

The names below load on first use (PEP 562), not when the package is imported: `python -m titanloop.eval` imports
this package before its __main__, and its `--help` and argument errors answer before torch loads."""

from __future__ import annotations

import importlib

# each name of __all__ -> the module that defines it
_EXPORTS = {
    "EvalConfig": "titanloop.eval.sweep",
    "REPORT_SCHEMA": "titanloop.eval.sweep",
    "LoopStats": "titanloop.eval.stats",
    "LoopStep": "titanloop.eval.trace",
    "collect_loop_stats": "titanloop.eval.stats",
    "depth_sweep": "titanloop.eval.sweep",
    "evaluate": "titanloop.eval.sweep",
    "eval_batches": "titanloop.eval.inputs",
    "exit_frontier": "titanloop.eval.sweep",
    "iter_loops": "titanloop.eval.trace",
    "load_model": "titanloop.checkpoint.loading",
    "loop_diagnostics": "titanloop.eval.sweep",
    "pareto_front": "titanloop.eval.exits",
    "validate_report": "titanloop.eval.report",
    "write_report": "titanloop.eval.report",
}
__all__ = [
    "EvalConfig",
    "REPORT_SCHEMA",
    "LoopStats",
    "LoopStep",
    "collect_loop_stats",
    "depth_sweep",
    "evaluate",
    "eval_batches",
    "exit_frontier",
    "iter_loops",
    "load_model",
    "loop_diagnostics",
    "pareto_front",
    "validate_report",
    "write_report",
]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
