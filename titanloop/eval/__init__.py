"""Evaluation and inference for looped LMs: depth sweeps, early-exit frontiers, per-loop diagnostics, plots,
KV-cache generation and an lm-eval-harness adapter. See docs/eval.md; CLI: `python -m titanloop.eval --help`."""

from titanloop.eval.exits import pareto_front
from titanloop.eval.inputs import eval_batches
from titanloop.checkpoint.loading import load_model
from titanloop.eval.report import validate_report, write_report
from titanloop.eval.stats import LoopStats, collect_loop_stats
from titanloop.eval.sweep import EvalConfig, REPORT_SCHEMA, depth_sweep, evaluate, exit_frontier, loop_diagnostics
from titanloop.eval.trace import LoopStep, iter_loops

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
