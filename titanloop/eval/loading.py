"""`load_model(path)`: the one place evaluation and generation load a checkpoint from disk.

Accepted formats:
  1. an Ouro Hugging Face directory (config.json with model_type "ouro" + model.safetensors or a sharded
     index), as written by `titanloop.interchange.ouro_hf.export_ouro_hf` or published by ByteDance;
  2. a DCP checkpoint directory (holds `.metadata`) — needs titanloop.checkpoint's model loader; until that
     exists it is refused with a one-line error that says to export an HF directory first.
Anything else is refused with a one-line ConfigError naming the path and the accepted formats.
"""

from __future__ import annotations

from pathlib import Path

import torch

from titanloop.config_errors import ConfigError
from titanloop.model import LoopLM

ACCEPTED = ("an Ouro Hugging Face directory (config.json + *.safetensors, from titanloop.interchange "
            "export_ouro_hf)", "a DCP checkpoint directory (.metadata)")


def checkpoint_format(path) -> str:
    """'ouro_hf' | 'dcp'; ConfigError for anything else."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"checkpoint path={str(p)!r} does not exist: expected {ACCEPTED[0]} or {ACCEPTED[1]}")
    if p.is_dir() and (p / "config.json").is_file():
        return "ouro_hf"
    if p.is_dir() and (p / ".metadata").is_file():
        return "dcp"
    raise ConfigError(f"checkpoint path={str(p)!r} is not a LoopLM checkpoint: expected {ACCEPTED[0]} "
                      f"or {ACCEPTED[1]}")


def _load_dcp(path: Path, device, dtype) -> LoopLM:
    try:
        from titanloop.checkpoint import load_looplm  # type: ignore[attr-defined]
    except ImportError:
        raise ConfigError(f"checkpoint path={str(path)!r} is a DCP checkpoint, which titanloop.eval cannot read "
                          "yet: export it to an Ouro HF directory (python -m titanloop.interchange export) and "
                          "pass that directory") from None
    model = load_looplm(path, device=device)
    return model.to(dtype) if dtype is not None else model


def load_model(path, device="cpu", dtype: torch.dtype | None = None) -> LoopLM:
    """Load a LoopLM from `path` (formats in the module docstring), in eval mode."""
    fmt = checkpoint_format(path)
    if fmt == "ouro_hf":
        from titanloop.interchange.ouro_hf import import_ouro_hf

        model = import_ouro_hf(path, device=device, dtype=dtype)
    else:
        model = _load_dcp(Path(path), device, dtype)
    if not isinstance(model, LoopLM):
        raise ConfigError(f"checkpoint path={str(path)!r} did not load as a LoopLM (got {type(model).__name__})")
    return model.eval()
