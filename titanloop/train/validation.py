"""Validation in the training loop: held-out loss at every loop, the exit distribution's expected depth and
Q-exit quality, every `validation.freq` steps and at the last step (the `[validation]` section).

The numbers are titanloop.eval's, computed on the training model as it is sharded (FSDP2 / TP / ZeRO):
one no-grad forward to the deepest loop count with `exit_readouts=True` (what the model decodes when it stops
at loop t, as the eval scores it), gathered over the sequence under sequence parallelism, then the eval's own
functions on this rank's tokens (`titanloop.eval.stats` per-token CE and correctness, `LoopStats.quality`,
`static_exit` / `q_exit` from `titanloop.eval.exits`, `diagnostics.exit_distribution`). Each rank's means are
turned into sums and counts and all-reduced once, so the result is the mean over every held-out token of every
rank: what `python -m titanloop.eval sweep` reports for the same data on the checkpoint of that step.

Held-out data (`validation.data`, default derived from `[data]`): a synthetic task's held-out split
(`eval_batches` of `steps * batch_size * dp` examples, batches dealt round-robin to the dp ranks) or, for any
other kind, the first `steps` global batches of its own PackedLoader sharded over the dp ranks (rank r reads its
part of global batches 0..steps-1; no sample is read by two ranks). With `steps = 0` a held-out shard set is
scored whole: every window of it once, in order, its batches dealt round-robin to the dp ranks. The batches are
read once, at the start, and kept on the CPU: every validation scores the same tokens.

Training is not changed: no parameter, optimizer or loader state is touched, torch / CUDA / Python / NumPy RNG
states are saved and restored around it, and under FSDP2 every module is resharded afterwards (the state the
next step would find anyway). Memory: no backward; the forward holds 2 x T_max [B, S, H] tensors (readouts and
raw states) and one [chunk, vocab] logits chunk, far below a training step's saved activations.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
import itertools
import math
import random
import time

import numpy as np
import torch
import torch.distributed as dist

from titanloop.eval.diagnostics import exit_distribution
from titanloop.eval.exits import q_exit, static_exit
from titanloop.eval.stats import LoopStats, _head_stats, take_tokens, scored_index, unpack_head_stats
from titanloop.objectives import IGNORE_INDEX
from titanloop.parallel import gather_sequence
from titanloop.train.callbacks import Callback, StepResult
from titanloop.config_errors import ConfigError, require
from titanloop.data import build_dataloader
from titanloop.data.config import SHARD_KINDS, DataConfig
from titanloop.data.shards import whole_set_batches
from titanloop.data.synthetic_tasks import build_task, eval_batches


@dataclass
class ValidationSection:
    """Held-out evaluation during training (titanloop.train.validation); off unless enable = true."""

    enable: bool = False
    freq: int = 1000  # steps between validations (also at the last step)
    steps: int = 4  # batches per data-parallel rank; 0: a held-out shard set whole (every window once)
    batch_size: int = 0  # rows per batch per data-parallel rank (0 = training.micro_batch_size)
    loops: list = field(default_factory=list)  # loop counts T to score ([] = 1..T_train and 2 x T_train)
    q: list = field(default_factory=lambda: [0.5, 0.8, 0.9])  # Q-exit thresholds (ouro §3.2) over T_train loops
    # The held-out set: a titanloop.data DataConfig table ([validation.data]). {} = derived from [data]: a
    # synthetic task's held-out split (split = "eval"), or synthetic text with seed + 1; shard sets need their own.
    data: dict = field(default_factory=dict)
    held_out: DataConfig | None = field(init=False, repr=False, default=None)  # `data` resolved (and checked)

    def validate(self, train_data: DataConfig):
        require(self.freq >= 1, "validation.freq", self.freq, "an integer >= 1 (steps between validations)")
        require(
            self.steps >= 0,
            "validation.steps",
            self.steps,
            "an integer >= 1 (batches per data-parallel rank), or 0 for a held-out shard set whole",
        )
        require(
            self.batch_size >= 0,
            "validation.batch_size",
            self.batch_size,
            "an integer >= 1, or 0 for training.micro_batch_size",
        )
        for t in self.loops:
            require(
                isinstance(t, int) and not isinstance(t, bool) and t >= 1,
                "validation.loops",
                t,
                "integers >= 1 (loop counts T)",
            )
        for q in self.q:
            require(isinstance(q, (int, float)) and 0 <= q <= 1, "validation.q", q, "thresholds in [0, 1]")
        if self.data:
            self.held_out = DataConfig.from_dict(self.data)
        elif train_data.kind == "synthetic_task":
            self.held_out = dataclasses.replace(train_data, split="eval", trace_samples=None)
        elif train_data.kind == "synthetic_text":
            self.held_out = dataclasses.replace(train_data, seed=train_data.seed + 1, trace_samples=None)
        elif self.enable:
            raise ConfigError(
                f"validation.data is empty with data.kind={train_data.kind!r}: give the held-out shard "
                "sets as [validation.data] kind = ..., sources = [{path = ...}]"
            )
        if self.steps == 0 and self.held_out is not None:
            require(
                self.held_out.kind in SHARD_KINDS,
                "validation.steps",
                0,
                f"an integer >= 1 with held-out data of kind {self.held_out.kind!r} (0, the whole set, is for shard "
                "sets)",
            )

    def loop_counts(self, t_train: int, m) -> list[int]:
        """The loop counts validation scores: `loops`, or 1..T_train and 2 x T_train (T_train: the loop sampler's
        n_loops, the depth titanloop.eval treats as trained; capped at the model's max_loops with per_loop_norm).
        m: the model's LoopLMConfig-shaped view."""
        loops = self.loops or [*range(1, t_train + 1), 2 * t_train]
        if m.per_loop_norm and not self.loops:
            loops = [t for t in loops if t <= m.max_loops]
        return sorted(set(loops))


def batch_size(cfg) -> int:
    return cfg.validation.batch_size or cfg.training.micro_batch_size


def held_out_batches(cfg, dp_rank: int, dp_world: int) -> list[dict]:
    """This data-parallel rank's held-out batches (CPU tensors), the same at every validation (cfg: the run's
    TrainConfig)."""
    v, d, b = cfg.validation, cfg.validation.held_out, batch_size(cfg)
    if d.kind == "synthetic_task" and d.split == "eval":
        options = {k: val for k, val in d.task_options.items() if k != "train_size"}
        task = build_task(d.task, seed=d.seed, **options)
        every = list(eval_batches(task, v.steps * b * dp_world, b, seed=d.seed))
        return every[dp_rank::dp_world]

    if v.steps == 0:  # the whole held-out set, every window once, its batches dealt round robin to the ranks
        every = whole_set_batches(d, seq_len=cfg.training.seq_len, vocab_size=cfg.looplm.vocab_size, batch_size=b)
        return every[dp_rank::dp_world]
    loader = build_dataloader(
        dataclasses.replace(d, prefetch=0),
        seq_len=cfg.training.seq_len,
        micro_batch_size=b,
        global_batch_size=b * dp_world,
        dp_rank=dp_rank,
        dp_world=dp_world,
        vocab_size=cfg.looplm.vocab_size,
    )
    try:
        return list(itertools.islice(iter(loader), v.steps))
    finally:
        loader.close()


class _SavedRNG:
    """torch (CPU and CUDA), Python and NumPy RNG states, restored on exit."""

    def __enter__(self):
        self.torch = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        self.python, self.numpy = random.getstate(), np.random.get_state()
        return self

    def __exit__(self, *exc):
        torch.set_rng_state(self.torch)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        random.setstate(self.python)
        np.random.set_state(self.numpy)
        return False


def _reshard(model) -> None:
    """Under FSDP2: free every gathered parameter (the root keeps its gathered ones after a forward)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


@torch.no_grad()
def rank_stats(run, batches: list[dict], n_loops: int) -> LoopStats | None:
    """Per-token, per-loop CE, correctness and gate logits of this rank's batches (titanloop.eval.stats), from
    the training model's forward; None when this rank has no scored token."""
    cfg, mesh = run.cfg, run.mesh
    parts = {k: [] for k in ("ce", "correct", "margin", "ash", "gate", "row")}
    row_offset = 0
    for batch in batches:
        ids, labels = batch["input_ids"].to(mesh.device), batch["labels"].to(mesh.device)
        doc_ids = batch.get("doc_ids")
        use_docs = doc_ids.to(mesh.device) if doc_ids is not None and cfg.training.doc_masking else None
        scored_cpu = batch["labels"] != IGNORE_INDEX
        index = scored_index(batch["labels"]).to(mesh.device)  # no device sync: indices from the CPU labels

        def fn(model, ids=ids, labels=labels, use_docs=use_docs, index=index):
            out = model(ids, n_loops, doc_ids=use_docs, exit_readouts=True)
            readouts = torch.stack([take_tokens(gather_sequence(r, mesh.sp_mesh), index) for r in out.readouts])
            gates = gather_sequence(out.gate_logits, mesh.sp_mesh, seq_dim=2).flatten(1).index_select(1, index)
            head = _head_stats(readouts, model.lm_head.weight, labels.flatten()[index], cfg.objective.ce_chunk_size)
            return torch.cat([head, gates.float()[None]]).cpu()  # the batch's one device-to-host copy

        packed = run.engine.forward(fn)
        for k, v in zip(("ce", "correct", "margin", "ash", "gate"), (*unpack_head_stats(packed), packed[4])):
            parts[k].append(v)
        # an example is a row, or a document of a packed row (the eval's key)
        key = torch.arange(ids.shape[0])[:, None] * (ids.shape[1] + 1) + row_offset
        if doc_ids is not None:
            key = key + doc_ids
        parts["row"].append(key.expand(ids.shape)[scored_cpu])
        row_offset += ids.shape[0] * (ids.shape[1] + 1)
    if not parts["ce"] or sum(c.shape[1] for c in parts["ce"]) == 0:
        return None
    ce = torch.cat(parts["ce"], 1)
    row = torch.unique(torch.cat(parts["row"]), return_inverse=True)[1]
    return LoopStats(
        ce=ce,
        correct=torch.cat(parts["correct"], 1),
        margin=torch.cat(parts["margin"], 1),
        ash_delta=torch.cat(parts["ash"], 1),
        hidden_delta=torch.zeros_like(ce),
        gate_logits=torch.cat(parts["gate"], 1),
        row=row,
        n_rows=int(row.max()) + 1,
        state_rms=torch.zeros(ce.shape[0], 0),
    )


def _sums(stats: LoopStats | None, loops: list[int], qs: list[float], t_train: int) -> list[float]:
    """Means of this rank turned into sums over its tokens (examples for sequence accuracy), plus the counts."""
    n_fields = 2 + 3 * len(loops) + 1 + 3 * len(qs)
    if stats is None:
        return [0.0] * n_fields
    n, rows = stats.n_tokens, stats.n_rows
    out = [float(n), float(rows)]
    for t in loops:
        p = stats.quality(static_exit(n, t))
        out += [p["loss"] * n, p["token_accuracy"] * n, p["sequence_accuracy"] * rows]
    out.append(exit_distribution(stats, t_train)["mean_exit_loop"] * n)
    for q in qs:
        p = stats.quality(q_exit(stats.gate_logits[:t_train], q))
        out += [p["avg_loops"] * n, p["loss"] * n, p["token_accuracy"] * n]
    return out


def validate(run, batches: list[dict]) -> dict:
    """One validation over every rank's held-out batches -> {"val/...": value} (the same on every rank)."""
    cfg, mesh = run.cfg, run.mesh
    start = time.perf_counter()
    t_train = cfg.loop_sampler.n_loops  # T's one home
    loops, qs = cfg.validation.loop_counts(t_train, cfg.looplm), [float(q) for q in cfg.validation.q]
    model = run.engine.model
    dropout = cfg.looplm.dropout > 0  # switched off as titanloop.eval scores (only then: a compiled layer would
    #                                   compile again for the eval flag)
    with _SavedRNG():
        try:
            if dropout:
                model.eval()
            stats = rank_stats(run, batches, max(max(loops), t_train))
        finally:
            if dropout:
                model.train()
            _reshard(model)
    packed = torch.tensor(_sums(stats, loops, qs, t_train), dtype=torch.float64)
    if dist.is_initialized():
        packed = packed.to(mesh.device)
        dist.all_reduce(packed)  # tp replicas add the same tokens to numerators and counts alike
        packed = packed.cpu()
    v = packed.tolist()
    n, rows = max(v[0], 1.0), max(v[1], 1.0)
    out = {"val/tokens": v[0] / mesh.dims.tp}
    i = 2
    for t in loops:
        loss = v[i] / n
        out[f"val/loss/loop_{t}"] = loss
        out[f"val/ppl/loop_{t}"] = math.exp(min(loss, 80.0))
        out[f"val/token_acc/loop_{t}"] = v[i + 1] / n
        out[f"val/seq_acc/loop_{t}"] = v[i + 2] / rows
        i += 3
    out["val/exit_depth"] = v[i] / n
    i += 1
    for q in qs:
        out[f"val/q_exit/q{q:g}/avg_loops"] = v[i] / n
        out[f"val/q_exit/q{q:g}/loss"] = v[i + 1] / n
        out[f"val/q_exit/q{q:g}/token_acc"] = v[i + 2] / n
        i += 3
    out["val/seconds"] = time.perf_counter() - start
    return out


class Validation(Callback):
    """Every validation.freq steps and at the last step: `validate` on this rank's held-out batches; the result
    rides on the StepResult to the Metrics callback (stdout line, metrics.jsonl and W&B under val/)."""

    def __init__(self, run):
        self.freq = run.cfg.validation.freq
        self.batches: list[dict] | None = None

    def pre_train(self, run) -> None:
        with _SavedRNG():  # reading the held-out set leaves training's RNG streams where they were
            self.batches = held_out_batches(run.cfg, run.mesh.dp_rank, run.mesh.dp_world)

    def post_step(self, run, result: StepResult) -> None:
        if result.step % self.freq and result.step != run.cfg.training.steps:
            return
        result.validation = validate(run, self.batches)
