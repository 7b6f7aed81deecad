"""Activation checkpointing for the LoopLM, per decoder layer or per loop.

- "layer": every decoder layer is wrapped with checkpoint_wrapper (non-reentrant); a looped layer then
  keeps only its input per loop and recomputes its internals in backward (T inputs per layer are saved).
- "loop": `model.loop_wrapper` runs each application of the looped block (loop_step) under
  torch.utils.checkpoint; only the T loop inputs are saved, everything inside the stack is recomputed.
  This is the cheaper-in-memory choice for deep loops; the model itself stays unchanged.
"""

from __future__ import annotations

import functools

from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import checkpoint

from titanloop.config_errors import require_choice
from titanloop.model import LoopLM


def _checkpointed(fn):
    return functools.partial(checkpoint, fn, use_reentrant=False)


def apply_activation_checkpointing(model: LoopLM, mode: str) -> None:
    """mode: 'none' | 'layer' | 'loop' (see the module docstring)."""
    require_choice(mode, "parallelism.activation_checkpoint", ("none", "layer", "loop"))
    if mode == "loop":
        model.loop_wrapper = _checkpointed
    elif mode == "layer":
        for stack in (model.prelude, model.layers, model.coda):
            for i, layer in enumerate(stack):
                stack[i] = checkpoint_wrapper(layer)
