"""Checkpoint settings: the `[checkpoint]` section of a train config, and what titanloop.checkpoint reads."""

from __future__ import annotations

from dataclasses import dataclass, field

from titanloop.config_errors import require, require_choice

SAVE_MODES = ("auto", "sync", "async")


@dataclass
class CheckpointConfig:
    enable: bool = True
    folder: str = "checkpoints"  # relative to the run dir
    interval: int = 500  # periodic save every `interval` optimizer steps (the trainer also saves the last step)
    keep_latest_k: int = 3  # keep the newest k published checkpoints (0: all) ...
    keep_every: int = 0  # ... plus every checkpoint whose step is a multiple of M, forever (0: none)
    mode: str = "auto"  # auto: async (dcp.async_save) on CUDA, sync on CPU; or force sync / async
    checksums: bool = True  # crc32 of every file in the manifest, verified before a load
    # the trainer's preemption protocol (titanloop.checkpoint.preemption, docs/checkpointing.md)
    preemption_signals: list = field(default_factory=lambda: ["SIGUSR1", "SIGTERM"])
    slurm_time_margin_s: float = 0.0  # > 0: also save and stop when less Slurm time than this is left

    def __post_init__(self):
        require(self.interval >= 1, "checkpoint.interval", self.interval, "an integer >= 1 (steps between saves)")
        require(
            self.keep_latest_k >= 0, "checkpoint.keep_latest_k", self.keep_latest_k, "an integer >= 0 (0 keeps all)"
        )
        require(self.keep_every >= 0, "checkpoint.keep_every", self.keep_every, "an integer >= 0 (0 disables)")
        require_choice(self.mode, "checkpoint.mode", SAVE_MODES)
        require(
            bool(self.folder) and not self.folder.startswith("/") and ".." not in self.folder,
            "checkpoint.folder",
            self.folder,
            "a relative folder name inside the run dir",
        )
