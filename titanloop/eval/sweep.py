"""The evaluation API: depth sweep, exit frontier, per-loop diagnostics, and `evaluate` for all three.

    from titanloop.eval import load_model, evaluate, write_report
    model = load_model("out/hf")                       # or any LoopLM in memory
    report = evaluate(model, dataset, EvalConfig(loops=[1, 2, 4, 8]))
    paths = write_report(report, "out/eval")          # report.json + depth_curve.png, pareto.png, ...

Each function also works alone: `depth_sweep(model, dataset, loops=[...])`, `exit_frontier(model, dataset)`,
`loop_diagnostics(model, dataset)`. All of them take the same `dataset` forms (titanloop.eval.inputs).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from titanloop.config_errors import ConfigError, require
from titanloop.eval import diagnostics as diag
from titanloop.eval.exits import (
    DEFAULT_ASH_EPS,
    DEFAULT_ASH_PATIENCE,
    DEFAULT_MARGIN,
    DEFAULT_Q,
    check_unit_thresholds,
    exit_frontier_from_stats,
    static_exit,
)
from titanloop.eval.inputs import eval_batches
from titanloop.eval.stats import LoopStats, collect_loop_stats
from titanloop.model import LoopLM

REPORT_SCHEMA = "titanloop.eval/v1"
# The default depth sweep: log-spaced loop counts far past any trained depth. One forward to the deepest (loop t+1
# continues from loop t's state), so its cost is that of T = 64 alone, not of the sum over the list.
DEPTH_LOOPS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def depth_loops(trained: int, max_loops: int | None = None) -> list[int]:
    """DEPTH_LOOPS with the trained depth added, capped at `max_loops` (per_loop_norm models stop there)."""
    loops = sorted({*DEPTH_LOOPS, int(trained)})
    return [t for t in loops if max_loops is None or t <= max_loops]


@dataclass
class EvalConfig:
    loops: list[int] | None = None  # depth sweep T values; default depth_loops: 1, 2, 3, 4, 6, 8, ..., 48, 64
    exit_loops: int | None = None  # T_max for the exit strategies and p(t); default the deepest swept T
    q_thresholds: list[float] = field(default_factory=lambda: list(DEFAULT_Q))
    margin_thresholds: list[float] = field(default_factory=lambda: list(DEFAULT_MARGIN))
    hidden_eps: list[float] | None = None  # None: quantiles of the observed hidden-state changes
    ash_eps: list[float] = field(default_factory=lambda: list(DEFAULT_ASH_EPS))
    ash_patience: list[int] = field(default_factory=lambda: list(DEFAULT_ASH_PATIENCE))
    batch_size: int = 8  # rows per batch for lists of sequences and DataConfig datasets
    max_batches: int | None = None  # cap on batches (loaders/DataConfig default to 8)
    seq_len: int = 256  # row length for DataConfig datasets
    chunk_size: int = 1024  # tokens per LM-head chunk
    jsrr_loops: list[int] | None = None  # default {1, n_loops, 2*n_loops} within the sweep
    jsrr_rows: int = 2
    jsrr_power_steps: int = 10
    radial_rows: int = 4  # rows of the first batch used for the radial-gradient fraction
    diagnostics: bool = True

    def validate(self, model_cfg) -> None:
        if self.loops is not None:
            require(len(self.loops) >= 1, "loops", self.loops, "a non-empty list of loop counts >= 1")
            for t in self.loops:
                require(
                    isinstance(t, int) and not isinstance(t, bool) and t >= 1,
                    "loops",
                    t,
                    "integers >= 1 (number of loops T)",
                )
            if model_cfg.per_loop_norm:
                require(
                    max(self.loops) <= model_cfg.max_loops,
                    "loops",
                    max(self.loops),
                    f"<= max_loops={model_cfg.max_loops} (per_loop_norm models have one norm per loop)",
                )
        require(
            self.exit_loops is None or int(self.exit_loops) >= 1,
            "exit_loops",
            self.exit_loops,
            "an integer >= 1 or None",
        )
        check_unit_thresholds(self.q_thresholds, "q_thresholds")
        check_unit_thresholds(self.margin_thresholds, "margin_thresholds")
        check_unit_thresholds(self.ash_eps, "ash_eps", upper=2.0)
        for m in self.ash_patience:
            require(int(m) >= 1, "ash_patience", m, "integers >= 1")
        if self.hidden_eps is not None:
            for e in self.hidden_eps:
                require(float(e) >= 0, "hidden_eps", e, "thresholds >= 0")
        if self.jsrr_loops is not None:
            for t in self.jsrr_loops:
                require(int(t) >= 1, "jsrr_loops", t, "integers >= 1")
        for name in ("batch_size", "seq_len", "chunk_size", "jsrr_rows", "jsrr_power_steps", "radial_rows"):
            require(int(getattr(self, name)) >= 1, name, getattr(self, name), "an integer >= 1")

    def sweep_loops(self, model_cfg) -> list[int]:
        if self.loops:
            return sorted(set(self.loops))
        # per_loop_norm models cannot run past max_loops
        return depth_loops(model_cfg.n_loops, model_cfg.max_loops if model_cfg.per_loop_norm else None)

    def max_exit_loops(self, model_cfg) -> int:
        """The exit strategies' T_max: `exit_loops`, else the deepest swept T (past the trained depth, at no extra
        forward: the sweep runs that deep anyway)."""
        return int(self.exit_loops or max(self.sweep_loops(model_cfg)))


def _check_model(model) -> LoopLM:
    if not isinstance(model, LoopLM):
        raise ConfigError(
            f"model of type {type(model).__name__} is invalid: expected a titanloop LoopLM "
            "(load one with titanloop.eval.load_model)"
        )
    return model


def _prepare(model, dataset, cfg: EvalConfig, progress=None):
    model = _check_model(model)
    cfg.validate(model.cfg)
    batches = eval_batches(
        dataset,
        batch_size=cfg.batch_size,
        max_batches=cfg.max_batches,
        seq_len=cfg.seq_len,
        vocab_size=model.cfg.vocab_size,
    )
    n = max(max(cfg.sweep_loops(model.cfg)), cfg.max_exit_loops(model.cfg))
    stats = collect_loop_stats(model, batches, n, chunk_size=cfg.chunk_size, progress=progress)
    return model, batches, stats


def depth_sweep_from_stats(stats: LoopStats, loops: list[int], trained_loops: int) -> dict:
    points = [{"loops": t, **stats.quality(static_exit(stats.n_tokens, t))} for t in loops]
    for p in points:
        p.pop("avg_loops")
    return {"trained_loops": trained_loops, "loops": list(loops), "points": points}


def depth_sweep(model, dataset, loops: list[int] | None = None, cfg: EvalConfig | None = None) -> dict:
    """Loss, perplexity and token/sequence accuracy at T = each of `loops` (default `depth_loops`, to T = 64)."""
    cfg = cfg or EvalConfig()
    if loops is not None:
        cfg = dataclasses.replace(cfg, loops=list(loops))
    model, _, stats = _prepare(model, dataset, cfg)
    return depth_sweep_from_stats(stats, cfg.sweep_loops(model.cfg), model.cfg.n_loops)


def exit_frontier(model, dataset, cfg: EvalConfig | None = None) -> dict:
    """Operating points (avg loops, quality) of static / Q-exit / hidden-diff / margin / ASH, and the frontier."""
    cfg = cfg or EvalConfig()
    cfg = dataclasses.replace(cfg, exit_loops=cfg.max_exit_loops(_check_model(model).cfg))
    model, _, stats = _prepare(model, dataset, dataclasses.replace(cfg, loops=[1]))
    return _frontier(stats, cfg, model)


def _frontier(stats, cfg: EvalConfig, model) -> dict:
    return exit_frontier_from_stats(
        stats,
        cfg.max_exit_loops(model.cfg),
        q_thresholds=cfg.q_thresholds,
        margin_thresholds=cfg.margin_thresholds,
        hidden_eps=cfg.hidden_eps,
        ash_eps=cfg.ash_eps,
        ash_patience=cfg.ash_patience,
    )


def _diagnostics(model, batches, stats, cfg: EvalConfig) -> dict:
    t_train = model.cfg.n_loops
    sweep_max = stats.n_loops
    jsrr = cfg.jsrr_loops or sorted({1, min(t_train, sweep_max), min(2 * t_train, sweep_max)})
    first = {k: (v[: cfg.radial_rows] if v is not None else None) for k, v in batches[0].items()}
    return {
        "hidden_rms": diag.hidden_norms(stats),
        "radial_gradient_fraction": diag.radial_gradient_fraction(model, first, sweep_max, cfg.chunk_size),
        "exit_distribution": diag.exit_distribution(stats, cfg.max_exit_loops(model.cfg)),
        "spectral_radius": diag.spectral_radius(model, batches[0], jsrr, cfg.jsrr_rows, cfg.jsrr_power_steps),
    }


def loop_diagnostics(model, dataset, cfg: EvalConfig | None = None) -> dict:
    """Hidden RMS per loop, radial-gradient fraction, exit distribution and JSRR ρ (titanloop.eval.diagnostics)."""
    cfg = cfg or EvalConfig()
    model, batches, stats = _prepare(model, dataset, cfg)
    return _diagnostics(model, batches, stats, cfg)


def evaluate(model, dataset, cfg: EvalConfig | None = None, *, progress=None, meta: dict | None = None) -> dict:
    """One pass over the data -> the full report (schema REPORT_SCHEMA): sweep, frontier, diagnostics."""
    cfg = cfg or EvalConfig()
    start = time.perf_counter()
    model, batches, stats = _prepare(model, dataset, cfg, progress=progress)
    report = {
        "schema": REPORT_SCHEMA,
        "model": {"config": model.cfg.to_dict(), "params": model.num_params(), **(meta or {})},
        "data": {"batches": len(batches), "examples": stats.n_rows, "scored_tokens": stats.n_tokens},
        "config": dataclasses.asdict(cfg),
        "depth_sweep": depth_sweep_from_stats(stats, cfg.sweep_loops(model.cfg), model.cfg.n_loops),
        "exit_frontier": _frontier(stats, cfg, model),
    }
    if cfg.diagnostics:
        if progress is not None:
            progress("diagnostics: radial-gradient fraction and JSRR spectral radius")
        report["diagnostics"] = _diagnostics(model, batches, stats, cfg)
    report["seconds"] = round(time.perf_counter() - start, 3)
    return report
