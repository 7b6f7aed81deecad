"""Step metrics to stdout, to <run_dir>/metrics.jsonl and to Weights & Biases (online, offline, or off),
from rank 0. The JSONL file holds the same numbers at full precision, one object per logged step.

W&B: `metrics.wandb = "online" | "offline" | "off"`; WANDB_MODE=offline in the environment turns an
online run into an offline one. W&B never stops training: an online run that cannot reach W&B (wandb.init gives
up after WANDB_INIT_TIMEOUT seconds, default 90) logs offline instead, and any later W&B error turns W&B off
for the rest of the run (stdout and metrics.jsonl continue). The run id is created once and stored in
`<run_dir>/wandb_run_id`, so a resumed job (same run_dir) continues the same W&B run. The API key is read by
wandb itself from its usual places (WANDB_API_KEY, ~/.netrc); titanloop never reads, logs or stores it, and
the W&B config is the training config (TrainConfig.to_dict), which has no secret fields.

MFU = achieved model FLOP/s / (peak FLOP/s x ranks), with FLOPs per token from
LoopLMConfig.flops_per_token (which counts every loop) and the device's bf16 dense peak (titanloop.train.mfu,
named on the startup line). Where no peak is known (the CPU, a device not in its table) MFU is reported as n/a
and the achieved TFLOP/s is shown.
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path

from titanloop.config_errors import require, require_choice
from titanloop.train.step_timer import breakdown_line

RUN_ID_FILE = "wandb_run_id"
CHART_POINTS = 256  # points per series in the loss-by-loop charts (the history is subsampled evenly)
CHART_EVERY = 100  # logged steps between two loss-by-loop charts (and at every validation)
WANDB_MODES = ("off", "online", "offline")


@dataclass
class MetricsSection:
    log_freq: int = 1  # steps between metric lines
    wandb: str = "off"  # off | online | offline (WANDB_MODE=offline in the environment also forces offline)
    wandb_project: str = "titanloop"
    wandb_entity: str | None = None
    run_name: str | None = None
    # count each step's collectives (CommDebugMode) and log them as comm/<kind>; with float8.recipe also the float8
    # weight casts (comm/float8_weight_cast, eager mode only)
    count_comms: bool = False
    # Step-time breakdown on log steps (titanloop.train.step_timer): data wait, forward + objective, backward,
    # loss all-reduce, optimizer; a barrier ends each phase on log steps only, so waiting for other ranks is its
    # own row and the slowest rank can be named. false: no barriers, no breakdown.
    breakdown: bool = True
    # Whole-step profile on log steps (titanloop.train.step_timer): every part of the iteration from the callbacks'
    # pre_step to their post_step, timed (a device synchronize after each on CUDA), to stdout and
    # <run_dir>/step_profile.jsonl. false: free.
    step_profile: bool = False
    straggler_warn: float = 0.0  # warn when a rank's busy time is this many times the median rank's (0 = never)

    def validate(self):
        require(self.log_freq >= 1, "metrics.log_freq", self.log_freq, "an integer >= 1")
        require_choice(self.wandb, "metrics.wandb", WANDB_MODES)
        require(
            self.straggler_warn == 0 or self.straggler_warn > 1,
            "metrics.straggler_warn",
            self.straggler_warn,
            "0 (off) or a ratio > 1, e.g. 1.5 (warn when a rank is 1.5x slower than the median)",
        )


def git_commit(repo: str | os.PathLike = Path(__file__).resolve().parents[2]) -> dict:
    """{"commit": sha or None, "dirty": bool or None} of the titanloop checkout (recorded in the W&B config)."""

    def git(*args):
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=10)

    try:
        sha = git("rev-parse", "HEAD")
        if sha.returncode != 0:
            return {"commit": None, "dirty": None}
        return {
            "commit": sha.stdout.strip(),
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no").stdout.strip()),
        }
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def _subsample(points: list, n: int = CHART_POINTS) -> list:
    if len(points) <= n:
        return points
    return [points[round(i * (len(points) - 1) / (n - 1))] for i in range(n)]


def loss_by_loop_chart(history: list[tuple[int, dict]], title: str, prefix: str):
    """One W&B line chart with a line per loop: history is [(step, {loop: value})]."""
    import wandb

    loops = sorted({t for _, values in history for t in values})
    xs, ys = [], []
    for t in loops:
        pts = _subsample([(step, values[t]) for step, values in history if t in values])
        xs.append([p[0] for p in pts])
        ys.append([p[1] for p in pts])
    return wandb.plot.line_series(xs=xs, ys=ys, keys=[f"{prefix}{t}" for t in loops], title=title, xname="step")


def stable_run_id(run_dir: str | os.PathLike) -> str:
    """The run's W&B id: read from <run_dir>/wandb_run_id, created there on first use."""
    path = Path(run_dir) / RUN_ID_FILE
    if path.is_file():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    run_id = uuid.uuid4().hex[:12]
    tmp = path.with_suffix(".tmp")
    tmp.write_text(run_id + "\n")
    os.replace(tmp, path)
    return run_id


def wandb_mode(configured: str) -> str:
    if configured == "off":
        return "off"
    if os.environ.get("WANDB_MODE", "").lower() in ("offline", "dryrun"):
        return "offline"
    if os.environ.get("WANDB_MODE", "").lower() == "disabled":
        return "off"
    return configured


def format_vector(values, fmt: str = "{:.3f}") -> str:
    return " ".join(fmt.format(v) for v in values)


def validation_line(step: int, val: dict, t_train: int) -> str:
    """One stdout line: loss per loop count, perplexity at T_train and 2 x T_train, E[exit depth], Q-exit."""
    loops = sorted(int(k.rsplit("_", 1)[1]) for k in val if k.startswith("val/loss/loop_"))
    losses = " ".join(f"{t}:{val[f'val/loss/loop_{t}']:.3f}" for t in loops)
    ppl = " ".join(f"{t}:{val[f'val/ppl/loop_{t}']:.2f}" for t in loops if t in (t_train, 2 * t_train))
    qs = sorted({k.split("/")[2] for k in val if k.startswith("val/q_exit/")}, key=lambda s: float(s[1:]))
    q_part = " ".join(f"{q[1:]}->{val[f'val/q_exit/{q}/loss']:.3f}@{val[f'val/q_exit/{q}/avg_loops']:.2f}" for q in qs)
    return (
        f"val  {step:5d} | loss/T {losses} | ppl/T {ppl} | E[exit] {val['val/exit_depth']:.2f} of {t_train} | "
        f"q-exit loss@loops {q_part} | {int(val['val/tokens']):,} tokens {val['val/seconds']:.1f}s"
    )


def _val_losses(validation: dict) -> dict:
    return {int(k.rsplit("_", 1)[1]): v for k, v in validation.items() if k.startswith("val/loss/loop_")}


class MetricsLogger:
    """`log(step, scalars, per_loop)` prints one line and sends the same numbers to W&B (rank 0 only)."""

    def __init__(self, cfg, run_dir: str, rank: int, config_dict: dict, trained_loops: int = 1):
        self.rank = rank
        self.trained_loops = trained_loops  # T_train, for the validation line
        self.train_history: list[tuple[int, dict]] = []  # (step, {loop: ce}) of logged steps, for the W&B chart
        self.val_history: list[tuple[int, dict]] = []  # (step, {T: held-out loss})
        self.logged = 0
        self.run = None
        self.jsonl = Path(run_dir) / "metrics.jsonl"
        mode = wandb_mode(cfg.wandb)
        if rank != 0 or mode == "off":
            return
        import wandb

        run_id = stable_run_id(run_dir)
        # Online first; if W&B cannot be reached (wandb.init gives up after WANDB_INIT_TIMEOUT s, default 90),
        # the run logs offline into run_dir/wandb (upload later with `wandb sync`); if even that fails, W&B
        # is off. Training never stops because of W&B.
        for attempt in [mode, "offline"] if mode == "online" else [mode]:
            try:
                self.run = wandb.init(
                    project=cfg.wandb_project,
                    entity=cfg.wandb_entity,
                    name=cfg.run_name or run_id,
                    id=run_id,
                    resume="allow",
                    dir=str(run_dir),
                    mode=attempt,
                    config={**config_dict, "git": git_commit()},
                    settings=wandb.Settings(console="off", x_disable_stats=True, save_code=False),
                )
                print(f"[titanloop] W&B {attempt} run id {run_id} in {run_dir}", flush=True)
                break
            except Exception as e:  # noqa: BLE001 - any W&B failure (CommError, UsageError, ...)
                reason = (str(e).strip().splitlines() or [""])[0]
                then = (
                    "logging offline instead (upload later with `wandb sync`)"
                    if attempt == "online"
                    else "W&B is off for this run (stdout and metrics.jsonl continue)"
                )
                print(
                    f"[titanloop] warning: W&B {attempt} init failed ({type(e).__name__}: {reason}); {then}", flush=True
                )
                try:  # the failed run still holds its id in W&B's service: release it before the next attempt
                    wandb.teardown()
                except Exception:  # noqa: BLE001
                    pass

    def log(self, step: int, scalars: dict, per_loop: dict, validation: dict | None = None) -> None:
        if self.rank != 0:
            return
        mfu = scalars.get("mfu")
        line = (
            f"step {step:5d} | loss {scalars['loss']:.4f} | T {int(scalars['n_loops'])} | "
            f"ce/loop {format_vector(per_loop['ce'])} | p(t) {format_vector(per_loop['exit_prob'], '{:.2f}')} | "
            f"H(p) {scalars['gate_entropy']:.3f} | rms/loop {format_vector(per_loop['hidden_rms'], '{:.2f}')} | "
            f"gnorm {scalars['grad_norm']:.3f} | lr {scalars['lr']:.2e} | tok/s {scalars['tokens_per_s']:.0f} | "
            f"TFLOP/s {scalars['tflops']:.3f} | mfu {'n/a' if mfu is None else f'{100 * mfu:.1f}%'}"
        )
        if "jsrr" in scalars:
            line += f" | jsrr {scalars['jsrr']:.4f}"
        if "loop_change" in scalars:
            line += f" | loop change {scalars['loop_change']:.4f}"
        if scalars.get("skipped_steps"):
            line += f" | skipped {int(scalars['skipped_steps'])}"
        comms = {k[5:]: v for k, v in scalars.items() if k.startswith("comm/")}
        if comms:
            line += " | comms " + " ".join(f"{k}={v}" for k, v in comms.items())
        print(line, flush=True)
        if "time/step_s" in scalars:
            print(breakdown_line(step, scalars), flush=True)
        if validation:
            print(validation_line(step, validation, self.trained_loops), flush=True)
        self._jsonl({"step": step, **scalars, **per_loop, **(validation or {})})
        if self.run is not None:
            # sections: the scalars at the top, <stat>/loop_t per statistic (ce, exit_prob, hidden_rms), time/ (step
            # breakdown), val/ (validation), loss_by_loop/ (one chart with a line per loop, train and held-out)
            data = {k: v for k, v in scalars.items() if v is not None}
            for name, values in per_loop.items():
                for t, v in enumerate(values, start=1):
                    data[f"{name}/loop_{t}"] = v
            data.update(validation or {})
            self.train_history.append((step, dict(enumerate(per_loop.get("ce", []), start=1))))
            if validation:
                self.val_history.append((step, _val_losses(validation)))
            if validation or self.logged % CHART_EVERY == 0:
                data.update(self._charts())
            self.logged += 1
            self._wandb("log", data, step=step)

    def log_validation(self, step: int, validation: dict) -> None:
        """Validation numbers of a step whose training numbers are not logged (a skipped step)."""
        if self.rank != 0:
            return
        print(validation_line(step, validation, self.trained_loops), flush=True)
        self._jsonl({"step": step, **validation})
        if self.run is not None:
            self.val_history.append((step, _val_losses(validation)))
            self._wandb("log", {**validation, **self._charts()}, step=step)

    def _charts(self) -> dict:
        charts = {}
        try:
            if self.train_history:
                charts["loss_by_loop/train_ce"] = loss_by_loop_chart(self.train_history, "training CE by loop", "loop ")
            if self.val_history:
                charts["loss_by_loop/val_loss"] = loss_by_loop_chart(
                    self.val_history, "held-out loss by loop count", "T="
                )
        except Exception as e:  # noqa: BLE001 - a chart never stops training
            print(f"[titanloop] warning: W&B chart failed ({type(e).__name__}: {e})", flush=True)
        return charts

    def _jsonl(self, record: dict) -> None:
        self.jsonl.parent.mkdir(parents=True, exist_ok=True)
        with open(self.jsonl, "a") as f:
            f.write(json.dumps(record) + "\n")

    def _wandb(self, method: str, *args, **kwargs) -> None:
        """Call the W&B run, never letting W&B stop training: on a preemption SIGTERM Slurm also kills W&B's
        service process, and the save that follows must still happen. stdout and metrics.jsonl keep logging."""
        try:
            getattr(self.run, method)(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - any W&B failure
            print(
                f"[titanloop] warning: W&B {method} failed ({type(e).__name__}: {e}); W&B logging is off for the "
                "rest of this run (stdout and metrics.jsonl continue)",
                flush=True,
            )
            self.run = None

    def close(self) -> None:
        if self.run is not None:
            self._wandb("finish")
            self.run = None
