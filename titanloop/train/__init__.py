"""Distributed training of LoopLMs on torchtitan: `torchrun -m titanloop.train --config <file.toml>`.

Modules, in the order a run uses them: config (TOML schema + CLI overrides, every check that needs no process
group), startup (process group and meshes -> model -> engine -> data -> checkpointer, as small functions),
engine (the seam to FSDP2 + TP: backward, optimizer step, checkpointable states), loop (`train()` and one
step), objective (per-loop objective and statistics), callbacks (metrics, checkpointing, preemption,
non-finite losses, GC), metrics (stdout, metrics.jsonl, W&B), step_timer (step-time breakdown, stragglers),
validation (held-out loss per loop during training), profiling (torch.profiler traces, CUDA memory snapshots),
cpu_shim (torchtitan on a CPU-only host), process_exit (how a finished worker leaves).
Importing this package imports no torchtitan module. See docs/training.md and docs/architecture.md.
"""

from titanloop.train.config import TrainConfig, load_config

__all__ = ["TrainConfig", "load_config"]
