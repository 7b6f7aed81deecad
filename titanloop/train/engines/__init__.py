"""Training engines behind one seam (titanloop.train.engines.base): FSDP2 (+TP) and DeepSpeed ZeRO-2/3.

build_engine(cfg, model, mesh, param_dtype, load_weights)   the engine `parallelism.engine` names
check_engine_config(parallelism)                           each engine's own setting checks (config
                                                           validation calls it; one-line ConfigError)
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from titanloop.config_errors import require
from titanloop.train.engines.base import Engine, build_lr_schedulers, init_weights, optimizer_kwargs
from titanloop.train.engines.deepspeed import DeepSpeedEngine, build_deepspeed_engine, check_zero_settings
from titanloop.train.engines.fsdp2 import FSDP2Engine, build_fsdp2_engine, build_optimizer, parallelize

__all__ = [
    "DeepSpeedEngine",
    "Engine",
    "FSDP2Engine",
    "build_engine",
    "build_lr_schedulers",
    "build_optimizer",
    "check_engine_config",
    "init_weights",
    "optimizer_kwargs",
    "parallelize",
]


def check_engine_config(p) -> None:
    """The engine-specific checks of a [parallelism] section (p: ParallelismSection)."""
    if p.engine == "deepspeed":
        check_zero_settings(p.zero_stage, p.zero_offload)
        require(
            not p.compile,
            "parallelism.compile",
            p.compile,
            "false with parallelism.engine='deepspeed' (compile is supported with engine='fsdp2' only)",
        )


def build_engine(
    cfg, model: nn.Module, mesh, param_dtype: torch.dtype, load_weights: Callable[[nn.Module], None] | None = None
) -> Engine:
    """Parallelize / wrap the (meta) model, materialize it, then `load_weights` (a previous stage's, from startup),
    build its optimizer and LR schedule."""
    if cfg.parallelism.engine == "deepspeed":
        return build_deepspeed_engine(cfg, model, mesh.device, param_dtype, load_weights)
    return build_fsdp2_engine(cfg, model, mesh, param_dtype, load_weights)
