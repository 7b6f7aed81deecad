"""What every experiment shares: train a titanloop.train config in a subprocess, score held-out task data,
write the results table (json + markdown) and plot curves.

    from experiments import common
    args = common.parse_args("readout blind spot", default_steps=300)
    run = common.train("experiments/readout_blind_spot/base.toml", args.out / "norm",
                       {"model.readout": "norm", "training.steps": args.steps})
    points = common.heldout(run, loops=[1, 2, 4])          # depth sweep on the task's held-out split
    common.write_results(args.out, title=..., paper=..., columns=[...], rows=[...], verdict=...)

Training always goes through the real entry point (`torchrun -m titanloop.train --config ...`), so an
experiment exercises the same code, configs and DCP checkpoints as a user's run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import time
from pathlib import Path

from titanloop.train.launch import torchrun  # the one torchrun builder (tests/launch.py starts runs with it too)

REPO = Path(__file__).resolve().parents[1]
RESULTS_SCHEMA = "titanloop.experiments/v1"


def toml_literal(value) -> str:
    """A Python value as a TOML literal for a `--section.key value` override (bool, number, str, list, dict)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_literal(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_literal(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"override value {value!r} of type {type(value).__name__} has no TOML form")


def override_args(overrides: dict) -> list[str]:
    """{"training.steps": 10, "model.readout": "raw"} -> ["--training.steps", "10", "--model.readout", '"raw"']."""
    args = []
    for key, value in overrides.items():
        args += [f"--{key}", toml_literal(value)]
    return args


def train(
    config: str | os.PathLike,
    run_dir: str | os.PathLike,
    overrides: dict | None = None,
    nproc: int = 1,
    quiet: bool = True,
    keep_finished: bool = False,
) -> Path:
    """Train `config` (a TOML path, relative to the repo root or absolute) into a fresh `run_dir`.

    Runs `torchrun --standalone --nproc_per_node=nproc -m titanloop.train`; checkpoints are enabled so the final
    weights land in run_dir/checkpoints. The training log goes to run_dir/train.log (and stdout unless quiet).
    Raises RuntimeError with the log's tail when training fails.

    keep_finished: a run dir that already holds a finished run (its train_seconds, written last) is kept as it is,
    not trained again; an interrupted one (a checkpoint, no train_seconds) resumes from its newest checkpoint when
    that checkpoint was written by this very config and overrides, and is trained afresh otherwise (the reason is
    printed). A resumed run's train_seconds counts its last attempt only.
    """
    run_dir = Path(run_dir)
    if keep_finished and (run_dir / "train_seconds").is_file():
        print(f"kept the finished run {run_dir}", flush=True)
        return run_dir
    config = Path(config)
    if not config.is_absolute():
        config = REPO / config
    overrides = {
        "checkpoint.enable": True,
        "metrics.wandb": "off",
        **(overrides or {}),
        "training.run_dir": str(run_dir),
    }
    overrides.setdefault("checkpoint.interval", int(overrides.get("training.steps", 10**9)))
    args = override_args(overrides)
    resume = keep_finished and _resumable(run_dir, config, args, nproc)
    if not resume:
        if run_dir.exists():
            shutil.rmtree(run_dir)
        run_dir.mkdir(parents=True)
    cmd = torchrun(nproc, "-m", "titanloop.train", "--config", str(config), *args)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "WANDB_MODE": "offline",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    start = time.perf_counter()
    log_path = run_dir / "train.log"
    # line-buffered: `tail -f train.log` follows a running job; a resumed run appends to its log
    with open(log_path, "a" if resume else "w", buffering=1) as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            log.write(line)
            if not quiet:
                print(line, end="", flush=True)
        code = proc.wait()
    if code != 0:
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-15:])
        raise RuntimeError(f"training {config.name} -> {run_dir} failed (exit {code}); end of {log_path}:\n{tail}")
    (run_dir / "train_seconds").write_text(f"{time.perf_counter() - start:.1f}\n")
    return run_dir


def _resumable(run_dir: Path, config: Path, args: list[str], nproc: int) -> bool:
    """Whether the interrupted run in run_dir can resume: it has a checkpoint, and the config that checkpoint saved
    is the one `config` with `args` resolves to now. Says why not, when there is a run dir to say it of."""
    from titanloop.checkpoint import layout
    from titanloop.train.config import load_config

    root = run_dir / "checkpoints"
    step = layout.latest_step(root) if root.is_dir() else None
    if step is None:
        if run_dir.exists():
            print(f"{run_dir} has no checkpoint to resume from: training it afresh", flush=True)
        return False
    saved = layout.read_manifest(root / layout.step_dir_name(step))["config"]
    wanted = json.loads(json.dumps(load_config(config, args, world_size=nproc).to_dict()))
    # every section of the run; `source` (where the TOML was read from) names the file, not what is trained. A field
    # the checkpoint lacks was added to titanloop after it was written: the run is the same only where the
    # experiment leaves that field at its default (what the older code did without it)
    default = json.loads(json.dumps(load_config(None, world_size=nproc).to_dict()))
    differ, newer = [], []
    for name in sorted((set(saved) | set(wanted)) - {"source"}):
        old, new = saved.get(name), wanted.get(name)
        if isinstance(old, dict) and isinstance(new, dict):
            added = sorted(set(new) - set(old))
            newer += [f"{name}.{k}" for k in added]
            if any(old[k] != new.get(k) for k in old) or any(new[k] != default[name].get(k) for k in added):
                differ.append(name)
        elif old != new:
            differ.append(name)
    if differ:
        print(
            f"{run_dir}'s checkpoint at step {step} was trained with another [{', '.join(differ)}]: training it afresh",
            flush=True,
        )
        return False
    if newer:
        print(f"{run_dir}'s checkpoint predates {', '.join(newer)}, asked for at the defaults", flush=True)
    print(f"resuming the interrupted run {run_dir} from its checkpoint at step {step}", flush=True)
    return True


def run_options(args: argparse.Namespace) -> dict:
    """train()'s keywords from the flags every experiment takes (parse_args): nproc and keep_finished."""
    return {"nproc": args.nproc, "keep_finished": args.keep_finished}


def train_many(jobs: list[tuple], parallel: int = 1, **options) -> list[Path]:
    """train(config, run_dir, overrides, **options) for each (config, run_dir, overrides) job, `parallel` at a time;
    `options` are train()'s keywords, run_options(args) for an experiment's flags."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        return list(pool.map(lambda job: train(*job, **options), jobs))


def metrics(run_dir: str | os.PathLike) -> list[dict]:
    """The logged steps of a run (run_dir/metrics.jsonl): loss, per-loop ce, exit_prob, hidden_rms, ...; of a run
    still writing it, the complete lines."""
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines(keepends=True)
    return [json.loads(line) for line in lines if line.endswith("\n") and line.strip()]


def load(run_dir: str | os.PathLike):
    """The trained LoopLM of a run (its newest checkpoint), in eval mode."""
    from titanloop.eval import load_model

    return load_model(Path(run_dir) / "checkpoints")


def heldout(
    model_or_run,
    loops: list[int] = (1,),
    data: dict | None = None,
    n_examples: int = 256,
    batch_size: int = 64,
    seq_len: int = 256,
) -> list[dict]:
    """Depth sweep on held-out data: one {loops, loss, perplexity, token_accuracy, sequence_accuracy} per T.

    `model_or_run` is a LoopLM or a run dir. `data` is a titanloop.data DataConfig dict; by default the run's own
    training data with split = "eval" (a synthetic task's held-out examples, one per row, scored on the answer
    only). sequence_accuracy is then exact-match answer accuracy.
    """
    import torch

    from titanloop.data import DataConfig
    from titanloop.eval import EvalConfig, depth_sweep

    model = model_or_run
    if not isinstance(model_or_run, torch.nn.Module):
        model = load(model_or_run)
        if data is None:
            data = {**run_config(model_or_run)["data"], "split": "eval"}
    if data is None:
        raise ValueError("heldout: pass data= (a DataConfig dict) when scoring a model that is not a run dir")
    cfg = EvalConfig(
        loops=list(loops),
        batch_size=batch_size,
        max_batches=math.ceil(n_examples / batch_size),
        seq_len=seq_len,
        diagnostics=False,
    )
    with torch.no_grad():
        return depth_sweep(model, DataConfig.from_dict(dict(data)), cfg=cfg)["points"]


def run_config(run_dir: str | os.PathLike) -> dict:
    """The resolved training config a run saved with its newest checkpoint (titanloop.json)."""
    from titanloop.checkpoint import layout

    root = Path(run_dir) / "checkpoints"
    step = layout.latest_step(root)
    if step is None:
        raise FileNotFoundError(f"{root} has no checkpoint: was the run trained with checkpoint.enable = true?")
    return layout.read_manifest(root / layout.step_dir_name(step))["config"]


def mean_std(values) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    values = [float(v) for v in values]
    m = sum(values) / len(values)
    var = sum((v - m) ** 2 for v in values) / (len(values) - 1) if len(values) > 1 else 0.0
    return m, math.sqrt(var)


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def markdown_table(columns: list[str], rows: list[dict]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def write_results(
    out: str | os.PathLike,
    *,
    name: str,
    title: str,
    paper: str,
    columns: list[str],
    rows: list[dict],
    verdict: str,
    reproduced: bool | str | None,
    command: str,
    smoke: bool,
    extra: dict | None = None,
) -> dict:
    """results.json + results.md in `out`: the table, the paper's claim beside it, and whether it reproduced.

    reproduced: True / False / "partly", or None when the run was too small to say or no model learned the task
    (smoke runs are always None).
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "schema": RESULTS_SCHEMA,
        "name": name,
        "title": title,
        "paper": paper,
        "command": command,
        "smoke": smoke,
        "reproduced": None if smoke else reproduced,
        "verdict": verdict,
        "columns": columns,
        "rows": rows,
        **(extra or {}),
    }
    (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    status = {True: "yes", False: "no", "partly": "partly", None: "not judged"}[result["reproduced"]]
    md = [
        f"# {title}",
        "",
        f"Command: `{command}`" + (" (smoke run: a few steps, not a result)" if smoke else ""),
        "",
        f"**Paper:** {paper}",
        "",
        markdown_table(columns, rows),
        "",
        f"**Direction reproduced:** {status}. {verdict}",
        "",
    ]
    if write_loss_curves(out):
        md += ["Per-loop training CE of every run: `loss_curves.png` (data: `loss_curves.json`).", ""]
    (out / "results.md").write_text("\n".join(md))
    return result


def loss_curves(out: str | os.PathLike) -> dict:
    """{run: {"step": [...], "ce": [[CE per loop] per logged step]}} from every <out>/<run>/metrics.jsonl (the
    trainer's metrics log; a resumed run's repeated steps are kept once)."""
    curves = {}
    for log in sorted(Path(out).glob("*/metrics.jsonl")):
        curve = loss_curve(log.parent)
        if curve["step"]:
            curves[log.parent.name] = curve
    return curves


def loss_curve(run_dir: str | os.PathLike) -> dict:
    """{"step": [...], "ce": [[CE per loop] per logged step]} of one run (a resumed run's repeated steps once)."""
    rows = sorted({r["step"]: r for r in metrics(run_dir) if "ce" in r}.values(), key=lambda r: r["step"])
    return {"step": [r["step"] for r in rows], "ce": [r["ce"] for r in rows]}


def write_loss_curves(out: str | os.PathLike) -> bool:
    """loss_curves.json + loss_curves.png in `out`: one panel per training run, one line per loop, so a loop that
    stalls is visible without reading logs. False (nothing written) when no run in `out` logged metrics."""
    curves = loss_curves(out)
    if not curves:
        return False
    (Path(out) / "loss_curves.json").write_text(json.dumps(curves) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(4, len(curves))
    rows = -(-len(curves) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.6 * rows), squeeze=False)
    for ax, (run, c) in zip(axes.flat, curves.items()):
        for t in range(max(len(ce) for ce in c["ce"])):
            pts = [(s, max(ce[t], 1e-4)) for s, ce in zip(c["step"], c["ce"]) if t < len(ce)]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=f"loop {t + 1}")
        ax.set(title=run, xlabel="step", ylabel="training CE", yscale="log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(curves) :]:
        ax.axis("off")
    _save(fig, Path(out) / "loss_curves.png")
    return True


def _figure(size: tuple[float, float]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=size)


def _save(fig, path: str | os.PathLike) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot(
    path: str | os.PathLike,
    series: dict[str, tuple[list, list]],
    *,
    xlabel: str,
    ylabel: str,
    title: str,
    logy: bool = False,
    logx: bool = False,
    vline: float | None = None,
) -> Path:
    """Line plot of {label: (xs, ys)} to `path` (PNG)."""
    fig, ax = _figure((6, 4))
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", label=label)
    if vline is not None:
        ax.axvline(vline, color="gray", linestyle="--", linewidth=1, label="trained T")
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    if logy:
        ax.set_yscale("log")
    if logx:
        ax.set_xscale("log", base=2)
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def bar_plot(path: str | os.PathLike, values: dict[str, float], *, ylabel: str, title: str, logy: bool = False) -> Path:
    """Bar chart of {label: value} to `path` (PNG)."""
    fig, ax = _figure((7, 4))
    ax.bar(list(values), list(values.values()))
    ax.set(ylabel=ylabel, title=title)
    if logy:
        ax.set_yscale("log")
    ax.tick_params(axis="x", labelrotation=20)
    return _save(fig, path)


def seed_list(text: str) -> list[int]:
    """--seeds: comma-separated integers, each once."""
    try:
        seeds = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 1,2,3, got {text!r}") from None
    if len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"{text!r} names a seed twice: give each seed once")
    return seeds


def positive_int(text: str) -> int:
    """--nproc, --parallel: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def parse_args(
    name: str, description: str, argv: list[str] | None = None, own: argparse.ArgumentParser | None = None
) -> argparse.Namespace:
    """The flags every experiment takes: --out, --smoke, --seeds, --nproc, --parallel, --keep-finished; `own` (an
    ArgumentParser made with add_help=False) adds an experiment's own flags, which --help then lists too."""
    p = argparse.ArgumentParser(
        prog=f"python -m experiments.{name}", description=description, parents=[own] if own is not None else []
    )
    p.add_argument(
        "--out",
        type=Path,
        default=REPO / "runs" / "experiments" / name,
        help=f"output directory (default runs/experiments/{name})",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="a few training steps of every run (CI): checks the pipeline, not the result",
    )
    p.add_argument(
        "--seeds",
        type=seed_list,
        default=[0],
        help="comma-separated training seeds (default 0)",
    )
    p.add_argument("--nproc", type=positive_int, default=1, help="processes per training run (default 1)")
    p.add_argument("--parallel", type=positive_int, default=1, help="training runs at a time (default 1)")
    p.add_argument(
        "--keep-finished",
        action="store_true",
        help="keep the runs of --out that finished and resume the interrupted ones from their newest checkpoint "
        "when their config is unchanged (an interrupted experiment trains only what is left); by default every run "
        "is trained afresh",
    )
    return p.parse_args(argv)
