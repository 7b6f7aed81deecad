"""The JSON report and its PNG plots (matplotlib, Agg backend: no display needed).

`write_report(report, out_dir)` writes, side by side:
    report.json        the dict from titanloop.eval.evaluate (schema "titanloop.eval/v1", checked first)
    depth_curve.png    loss and accuracy vs loops T, trained depth marked
    pareto.png         every exit strategy's operating points, loss and accuracy vs average loops, frontier
    hidden_norms.png   hidden-state RMS per loop (mean, median, p99, max; log scale)
The report is written to a temporary file and renamed, so an interrupted run never leaves a half report.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from titanloop.config_errors import ConfigError
from titanloop.eval.sweep import REPORT_SCHEMA

REQUIRED = {
    "schema": str,
    "model": dict,
    "data": dict,
    "config": dict,
    "depth_sweep": dict,
    "exit_frontier": dict,
}
SWEEP_POINT = ("loops", "loss", "perplexity", "token_accuracy", "sequence_accuracy")
FRONTIER_POINT = ("strategy", "param", "avg_loops", "loss", "perplexity", "token_accuracy", "sequence_accuracy")
STRATEGIES = ("static", "q_exit", "hidden_diff", "logit_margin", "ash")


def validate_report(report: dict) -> None:
    """Raise ConfigError naming the first missing or mistyped field of a titanloop.eval/v1 report."""
    for key, typ in REQUIRED.items():
        if not isinstance(report.get(key), typ):
            raise ConfigError(f"report[{key!r}] is missing or not a {typ.__name__}: expected a {REPORT_SCHEMA} report")
    if report["schema"] != REPORT_SCHEMA:
        raise ConfigError(f"report['schema']={report['schema']!r} is invalid: expected {REPORT_SCHEMA!r}")
    for i, p in enumerate(report["depth_sweep"].get("points", [])):
        missing = [k for k in SWEEP_POINT if k not in p]
        if missing:
            raise ConfigError(f"report['depth_sweep']['points'][{i}] lacks {missing}")
    if not report["depth_sweep"].get("points"):
        raise ConfigError("report['depth_sweep']['points'] is empty: expected one point per swept loop count")
    pts = report["exit_frontier"].get("points", [])
    for i, p in enumerate(pts):
        missing = [k for k in FRONTIER_POINT if k not in p]
        if missing or p["strategy"] not in STRATEGIES:
            raise ConfigError(
                f"report['exit_frontier']['points'][{i}] is invalid: needs {list(FRONTIER_POINT)} "
                f"with strategy in {list(STRATEGIES)}"
            )
    for metric, idx in report["exit_frontier"].get("pareto", {}).items():
        if any(not (0 <= j < len(pts)) for j in idx):
            raise ConfigError(f"report['exit_frontier']['pareto'][{metric!r}] has indices outside the points list")


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_depth_curve(report: dict, path: Path) -> None:
    plt = _plt()
    sweep = report["depth_sweep"]
    t = [p["loops"] for p in sweep["points"]]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    a1.plot(t, [p["loss"] for p in sweep["points"]], "o-")
    a1.set(xlabel="loops T", ylabel="loss (nats/token)", title="Depth sweep: loss")
    a2.plot(t, [p["token_accuracy"] for p in sweep["points"]], "o-", label="token accuracy")
    a2.plot(t, [p["sequence_accuracy"] for p in sweep["points"]], "s--", label="sequence accuracy")
    a2.set(xlabel="loops T", ylabel="accuracy", title="Depth sweep: accuracy")
    a2.legend()
    for ax in (a1, a2):
        ax.axvline(sweep["trained_loops"], color="gray", ls=":", label="trained depth")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_pareto(report: dict, path: Path) -> None:
    plt = _plt()
    fr = report["exit_frontier"]
    pts = fr["points"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    markers = {"static": "^", "q_exit": "o", "hidden_diff": "s", "logit_margin": "D", "ash": "v"}
    for ax, metric in zip(axes, ("loss", "token_accuracy")):
        for strat, marker in markers.items():
            sel = [p for p in pts if p["strategy"] == strat]
            if sel:
                ax.scatter(
                    [p["avg_loops"] for p in sel], [p[metric] for p in sel], marker=marker, label=strat, alpha=0.75
                )
        front = [pts[i] for i in fr["pareto"].get(metric, [])]
        ax.plot([p["avg_loops"] for p in front], [p[metric] for p in front], "k-", lw=1, label="Pareto frontier")
        ax.set(xlabel="average loops used", ylabel=metric, title=f"Exit strategies: {metric}")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_hidden_norms(report: dict, path: Path) -> None:
    plt = _plt()
    rows = report["diagnostics"]["hidden_rms"]
    fig, ax = plt.subplots(figsize=(6, 4))
    t = [r["loop"] for r in rows]
    for key, style in (("mean", "o-"), ("median", "s--"), ("p99", "^-"), ("max", "v:")):
        ax.plot(t, [r[key] for r in rows], style, label=key)
    values = [r[k] for r in rows for k in ("mean", "median", "p99", "max")]
    if all(v > 0 for v in values if math.isfinite(v)):
        ax.set_yscale("log")
    ax.set(xlabel="loop t", ylabel="RMS of hidden state H_t (per token)", title="Hidden-state scale per loop")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _json_safe(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def write_report(report: dict, out_dir) -> dict:
    """Validate `report`, write report.json and the PNG plots into out_dir; return {name: path}."""
    validate_report(report)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"out_dir={str(out)!r} is invalid: it is a file, expected a directory (or a new path)")
    out.mkdir(parents=True, exist_ok=True)
    paths = {"report": out / "report.json", "depth_curve": out / "depth_curve.png", "pareto": out / "pareto.png"}
    plot_depth_curve(report, paths["depth_curve"])
    plot_pareto(report, paths["pareto"])
    if "diagnostics" in report:
        paths["hidden_norms"] = out / "hidden_norms.png"
        plot_hidden_norms(report, paths["hidden_norms"])
    tmp = paths["report"].with_suffix(".json.tmp")
    tmp.write_text(json.dumps(_json_safe(report), indent=1, allow_nan=False))
    os.replace(tmp, paths["report"])
    return {k: str(v) for k, v in paths.items()}
