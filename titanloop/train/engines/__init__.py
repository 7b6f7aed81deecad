"""Training engines behind one seam (titanloop.train.engines.base): FSDP2 (+TP) and DeepSpeed ZeRO-2/3.

build_engine(settings, model, mesh, param_dtype, load_weights)   the engine `parallelism.engine` names
config                                                          the sections they read and their checks
                                                                (EngineSettings: all an engine is given)
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from titanloop.train.engines.base import Engine, build_lr_schedulers, init_weights
from titanloop.train.engines.config import EngineSettings
from titanloop.train.engines.deepspeed import DeepSpeedEngine, build_deepspeed_engine
from titanloop.train.engines.fsdp2 import FSDP2Engine, build_fsdp2_engine, build_optimizer, parallelize

__all__ = [
    "DeepSpeedEngine",
    "Engine",
    "EngineSettings",
    "FSDP2Engine",
    "build_engine",
    "build_lr_schedulers",
    "build_optimizer",
    "init_weights",
    "parallelize",
]


def build_engine(
    e: EngineSettings,
    model: nn.Module,
    mesh,
    param_dtype: torch.dtype,
    load_weights: Callable[[nn.Module], None] | None = None,
) -> Engine:
    """Parallelize / wrap the (meta) model, materialize it, then `load_weights` (a previous stage's, from startup),
    build its optimizer and LR schedule."""
    if e.parallelism.engine == "deepspeed":
        return build_deepspeed_engine(e, model, mesh.device, param_dtype, load_weights)
    return build_fsdp2_engine(e, model, mesh, param_dtype, load_weights)
