"""Held-out loss against depth for several runs in one picture (`python -m titanloop.eval compare`).

Each source is one curve, read from what titanloop already writes:
    a sweep's output directory or its report.json     `python -m titanloop.eval sweep --out DIR`: every swept T
    a training run directory (holding metrics.jsonl)   its last validation: every `val/loss/loop_T` it logged
The trained depth of each curve (marked on the plot) is the report's `trained_loops`, or for a run directory the
`[loop_sampler] n_loops` of the config its newest checkpoint saved (none without a checkpoint).

`write_depth_comparison(curves, out)` writes depth_comparison.png (loss against T on a log-2 axis, one line per
source, its trained depth marked) and depth_comparison.json ({"schema", "curves": [{label, source, trained_loops,
loops, loss}]}).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from titanloop.config_errors import ConfigError

COMPARE_SCHEMA = "titanloop.eval.compare/v1"
VAL_PREFIX = "val/loss/loop_"


def _from_report(path: Path) -> dict:
    from titanloop.eval.report import validate_report  # (its module imports the sweep's, which loads torch)

    try:
        report = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}): expected a sweep's report.json")
    validate_report(report)
    points = report["depth_sweep"]["points"]
    return {
        "loops": [int(p["loops"]) for p in points],
        "loss": [float(p["loss"]) for p in points],
        "trained_loops": report["depth_sweep"].get("trained_loops"),
    }


def _trained_loops_of_run(run_dir: Path) -> int | None:
    from titanloop.checkpoint import layout  # (only for run directories: the checkpoint package loads torch)

    root = run_dir / "checkpoints"
    step = layout.latest_step(root) if root.is_dir() else None
    if step is None:
        return None
    config = layout.read_manifest(root / layout.step_dir_name(step)).get("config", {})
    return config.get("loop_sampler", {}).get("n_loops")


def _from_run(run_dir: Path) -> dict:
    rows = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut short by a killed run
    rows = [r for r in rows if any(k.startswith(VAL_PREFIX) for k in r)]
    if not rows:
        raise ConfigError(
            f"{run_dir}/metrics.jsonl has no validation (no {VAL_PREFIX}T field): train with [validation] "
            "enable = true, or give the directory of a `python -m titanloop.eval sweep`"
        )
    last = rows[-1]
    loops = sorted(int(k[len(VAL_PREFIX) :]) for k in last if k.startswith(VAL_PREFIX))
    return {
        "loops": loops,
        "loss": [float(last[f"{VAL_PREFIX}{t}"]) for t in loops],
        "trained_loops": _trained_loops_of_run(run_dir),
        "step": last.get("step"),
    }


def depth_curve(source) -> dict:
    """One source (module docstring) -> {"source", "loops", "loss", "trained_loops"}."""
    path = Path(source)
    if path.is_file() and path.suffix == ".json":
        curve = _from_report(path)
    elif path.is_dir() and (path / "report.json").is_file():
        curve = _from_report(path / "report.json")
    elif path.is_dir() and (path / "metrics.jsonl").is_file():
        curve = _from_run(path)
    else:
        raise ConfigError(
            f"{str(source)!r} is not a depth curve: expected a `titanloop.eval sweep` output directory (or its "
            "report.json) or a training run directory holding metrics.jsonl"
        )
    return {"source": str(source), **curve}


def depth_curves(sources: list, labels: list[str] | None = None) -> list[dict]:
    """Every source's curve, labelled by `labels` (default: each source's directory name)."""
    if not sources:
        raise ConfigError("no source given: expected one or more sweep output or run directories")
    if labels is not None and len(labels) != len(sources):
        raise ConfigError(f"--labels has {len(labels)} name(s) for {len(sources)} source(s): give one per source")
    curves = []
    for i, source in enumerate(sources):
        curve = depth_curve(source)
        path = Path(source)
        default = (path.parent if path.is_file() else path).resolve().name
        curves.append({"label": labels[i] if labels else default, **curve})
    return curves


def write_depth_comparison(curves: list[dict], out_dir, title: str | None = None) -> dict:
    """depth_comparison.png and depth_comparison.json into out_dir -> {name: path}."""
    from titanloop.eval.report import _plt  # (as validate_report above)

    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out={str(out)!r} is invalid: it is a file, expected a directory (or a new path)")
    out.mkdir(parents=True, exist_ok=True)
    paths = {"plot": out / "depth_comparison.png", "json": out / "depth_comparison.json"}
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for c in curves:
        (line,) = ax.plot(c["loops"], c["loss"], "o-", ms=4, label=c["label"])
        t = c.get("trained_loops")
        if t is not None and t in c["loops"]:
            ax.plot([t], [c["loss"][c["loops"].index(t)]], "*", ms=14, color=line.get_color(), mec="black")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="loops T (log scale; * = trained depth)", ylabel="held-out loss (nats/token)")
    ax.set_title(title or "Held-out loss against depth")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(paths["plot"], dpi=100)
    plt.close(fig)
    tmp = paths["json"].with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"schema": COMPARE_SCHEMA, "curves": curves}, indent=1))
    os.replace(tmp, paths["json"])
    return {k: str(v) for k, v in paths.items()}


def format_table(curves: list[dict]) -> str:
    """Loss by T, one column per curve ('-' where a curve has no such T)."""
    loops = sorted({t for c in curves for t in c["loops"]})
    width = max(10, *(len(c["label"]) for c in curves))
    lines = ["loops | " + " | ".join(f"{c['label']:>{width}}" for c in curves)]
    for t in loops:
        cells = []
        for c in curves:
            v = c["loss"][c["loops"].index(t)] if t in c["loops"] else None
            mark = "*" if t == c.get("trained_loops") else " "
            cells.append(f"{'-' if v is None else f'{v:.4f}':>{width - 1}}{mark}")
        lines.append(f"{t:>5} | " + " | ".join(cells))
    return "\n".join(lines) + "\n(* trained depth)"
