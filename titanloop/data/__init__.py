"""titanloop data: packed, mixed, globally resumable micro-batches for the trainer.

    from titanloop.data import DataConfig, build_dataloader
    loader = build_dataloader(cfg, seq_len=..., micro_batch_size=..., global_batch_size=..., dp_rank=...,
                              dp_world=..., vocab_size=...)
    batch = next(loader)  # input_ids, labels (-100 = ignore), doc_ids: LongTensor [micro_batch_size, seq_len]
                          # plus sample_ids [micro_batch_size]: global sample index of each row
    loader.state_dict() / loader.load_state_dict(d)  # global state, resumable on any dp_world

See docs/data.md for shard layouts and the resume-state format.
"""

from __future__ import annotations

from titanloop.config_errors import ConfigError, require
from titanloop.data.config import DataConfig, SourceConfig
from titanloop.data.errors import ShardError
from titanloop.data.loader import PackedLoader
from titanloop.data.synthetic_tasks import TaskSource, build_task
from titanloop.data.synthetic_text import SyntheticTextSource
from titanloop.data.shards import open_shard_sources


def build_dataloader(
    cfg: DataConfig,
    *,
    seq_len: int,
    micro_batch_size: int,
    global_batch_size: int,
    dp_rank: int,
    dp_world: int,
    vocab_size: int,
    batch_schedule=None,
    pin_memory: bool = False,
) -> PackedLoader:
    """The loader for one data-parallel rank; the global sample sequence does not depend on dp_world.

    batch_schedule: optional step (0-based) -> global batch in sequences (a batch-size ramp); the trainer
    must run `loader.grad_accum_at(step)` micro-batches in that step. pin_memory: page-locked batches, for
    asynchronous copies to a GPU."""
    require(seq_len >= 1, "seq_len", seq_len, "an integer >= 1")
    if cfg.kind == "synthetic_text":
        sources, weights = [SyntheticTextSource(seq_len, vocab_size, cfg.seed, motif_vocab=cfg.motif_vocab)], [1.0]
    elif cfg.kind == "synthetic_task":
        options = dict(cfg.task_options)
        train_size = options.pop("train_size", None)
        task = build_task(cfg.task, seed=cfg.seed, **options)
        require(
            task.vocab_size <= vocab_size,
            "vocab_size",
            vocab_size,
            f">= {task.vocab_size}, the vocabulary of task {cfg.task!r}",
        )
        if cfg.split == "eval":
            raise ConfigError(
                "data.split='eval' is for titanloop.data.synthetic_tasks.eval_batches, "
                "not the training loader: use split='train'"
            )
        sources, weights = [TaskSource(task, seq_len, cfg.seed, train_size)], [1.0]
    else:
        sources = open_shard_sources(cfg, seq_len=seq_len, vocab_size=vocab_size)
        weights = [s.weight for s in cfg.sources]
    return PackedLoader(
        sources,
        weights,
        kind=cfg.kind,
        seed=cfg.seed,
        micro_batch_size=micro_batch_size,
        global_batch_size=global_batch_size,
        dp_rank=dp_rank,
        dp_world=dp_world,
        prefetch=cfg.prefetch,
        batch_schedule=batch_schedule,
        trace_dir=cfg.trace_samples,
        pin_memory=pin_memory,
    )


__all__ = ["DataConfig", "SourceConfig", "build_dataloader", "PackedLoader", "ShardError", "ConfigError"]
