"""Activation checkpointing for the LoopLM: selective, per decoder layer or per loop.

- "selective": every decoder layer is wrapped with checkpoint_wrapper and a selective policy (torch's
  create_selective_checkpoint_contexts, as torchtitan's op-level SAC): the outputs of the matmuls and of the
  attention kernel are saved, everything else (norms, RoPE, activations, residual adds) is recomputed in backward.
  It costs memory between "none" and "layer" and recomputes only cheap elementwise work.
- "layer": every decoder layer is wrapped with checkpoint_wrapper (non-reentrant); a looped layer then
  keeps only its input per loop and recomputes its internals in backward (T inputs per layer are saved).
- "loop": `model.loop_wrapper` runs each application of the looped block (loop_step) under
  torch.utils.checkpoint; only the T loop inputs are saved, everything inside the stack is recomputed.
  This is the cheaper-in-memory choice for deep loops; the model itself stays unchanged.
  `kept_loops` = k (`parallelism.ac_kept_loops`) runs the first k loops without checkpointing: they keep their
  activations and backward recomputes only the other T - k loops. The peak (the backward of the first
  recomputed loop) holds k loops' activations plus one loop's recompute, whatever T a loop sampler draws, so k
  trades memory for recompute in steps of one loop, between "loop" (k = 0) and "none" (k >= T). The dry run's
  memory plan says what a k costs.
"""

from __future__ import annotations

import functools

from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from titanloop.config_errors import require, require_choice
from titanloop.model import LoopLM


# the policies, from the least recomputation to the least memory (the [parallelism] section checks its setting
# against this tuple)
AC_MODES = ("none", "selective", "layer", "loop")


def check_kept_loops(mode: str, kept_loops: int) -> None:
    """One-line ConfigError for a parallelism.ac_kept_loops that does not apply."""
    require(kept_loops >= 0, "parallelism.ac_kept_loops", kept_loops, "an integer >= 0")
    require(
        kept_loops == 0 or mode == "loop",
        "parallelism.ac_kept_loops",
        kept_loops,
        f"0 with parallelism.activation_checkpoint={mode!r} (it is the number of loops that per-loop AC leaves "
        "unrecomputed: set activation_checkpoint='loop' to use it)",
    )


def live_loops(mode: str, n_loops: int, kept_loops: int = 0) -> int | None:
    """How many loops' saved activations are live at backward's peak, in whole loops: every loop without AC; with
    per-loop AC the loops it keeps plus the one it recomputes (_checkpointed_after). None for the policies that do
    not hold whole loops (selective keeps part of every loop, layer one layer's)."""
    return {"none": n_loops, "loop": min(n_loops, 1 + kept_loops)}.get(mode)


def _checkpointed(fn):
    return functools.partial(checkpoint, fn, use_reentrant=False)


def _checkpointed_after(kept_loops: int):
    """A loop_wrapper that checkpoints loop_step(x, t, ...) for loops t >= kept_loops only (t counts from 0)."""

    def wrap(fn):
        checkpointed = _checkpointed(fn)

        def step(x, t, *args):
            return fn(x, t, *args) if t < kept_loops else checkpointed(x, t, *args)

        return step

    return wrap


def describe(mode: str, kept_loops: int = 0) -> str:
    """The AC policy as the startup line and the dry run name it, e.g. "loop (first 2 loops kept)"."""
    if mode == "loop" and kept_loops:
        return f"loop (first {kept_loops} loop{'s' if kept_loops > 1 else ''} kept)"
    return mode


# Ops whose outputs selective AC keeps (by name, so that every torch version's and kernel's variants match): the
# matmuls (float8's _scaled_mm included) and the attention kernels (SDPA's fused ones, torch's varlen_attn,
# flash-attn, FlexAttention).
_SAVED = ("mm", "addmm", "bmm", "_scaled_mm", "linear")
_SAVED_PARTS = ("attention", "varlen_attn", "flash_attn", "flex_attention")


def saves_output(op) -> bool:
    """Whether selective activation checkpointing saves `op`'s output instead of recomputing it."""
    name = str(getattr(op, "__name__", op)).split(".")[0].split("::")[-1]
    return name in _SAVED or any(part in name for part in _SAVED_PARTS)


def _selective_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if saves_output(op) else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    return create_selective_checkpoint_contexts(_selective_policy)


def apply_activation_checkpointing(model: LoopLM, mode: str, kept_loops: int = 0) -> None:
    """mode: 'none' | 'selective' | 'layer' | 'loop'; kept_loops: with 'loop', how many first loops are not
    checkpointed (see the module docstring)."""
    require_choice(mode, "parallelism.activation_checkpoint", AC_MODES)
    check_kept_loops(mode, kept_loops)
    if mode == "loop":
        model.loop_wrapper = _checkpointed_after(kept_loops) if kept_loops else _checkpointed
    elif mode in ("layer", "selective"):
        kwargs = {"context_fn": _selective_context} if mode == "selective" else {}
        for stack in (model.prelude, model.layers, model.coda):
            for i, layer in enumerate(stack):
                stack[i] = checkpoint_wrapper(layer, **kwargs)
