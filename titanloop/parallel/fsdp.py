"""FSDP2 (`fully_shard`) for the LoopLM, with the looped stack all-gathered once per step.

Units: one per decoder layer (prelude, looped stack, coda) and the root (embedding, final norm, exit gate,
LM head, optional recurrence gate / per-loop norms). Parameters are sharded over the data-parallel mesh
(and over tp as well for tensor-parallel DTensors: FSDP2 composes them into a 2-D layout).

A looped layer runs T times per forward and T times per backward. With the usual
reshard_after_forward=True each of those 2T calls would all-gather the layer again. `reshard_looped`
chooses:

- "never" (default): the looped (and coda) layers keep their unsharded parameters from the first loop's
  forward until the whole backward is done (reshard_after_forward=False and, since each of the T
  backward calls would otherwise reshard and the next one re-gather, reshard_after_backward=False too);
  `reshard_looped_layers` then frees them before the optimizer step. One all-gather and one
  reduce-scatter per layer per step. Memory cost: the looped stack is held unsharded (for Ouro 1.4B in
  bf16: 24 layers x 50M params x 2 B = 2.4 GB per GPU).
- "always": reshard after every use: the least memory, 2T all-gathers per layer per step.

Mixed precision: `param_dtype` (bf16 on GPU) for compute, `reduce_dtype` fp32 for gradient reduction;
the sharded master parameters and the optimizer state stay fp32. See docs/parallelism.md for the counts.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from titanloop.config_errors import require_choice
from titanloop.model import LoopLM

RESHARD_LOOPED = ("never", "always")  # see the module docstring; [parallelism] reshard_looped is checked against it


def apply_fsdp(
    model: LoopLM,
    dp_mesh: DeviceMesh,
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
    reshard_looped: str = "never",
) -> None:
    require_choice(reshard_looped, "parallelism.reshard_looped", RESHARD_LOOPED)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    looped_reshard = reshard_looped == "always"
    for layer in model.prelude:  # run once per forward: reshard as usual
        fully_shard(layer, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=True)
    for layer in [*model.layers, *model.coda]:  # run T times per forward
        fully_shard(layer, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=looped_reshard)
        layer.set_reshard_after_backward(looped_reshard)
    # The root's parameters (embedding, norm, gate, LM head) stay unsharded from forward to backward.
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=False)


def set_gradient_sync(model: torch.nn.Module, last_micro_batch: bool) -> None:
    """Gradient accumulation: reduce-scatter only after the last micro-batch of a step (the looped layers
    keep their own reshard_after_backward setting)."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(last_micro_batch, recurse=True)
        for module in model.modules():
            if isinstance(module, FSDPModule) and module not in _looped(model):
                module.set_reshard_after_backward(last_micro_batch, recurse=False)


def _looped(model) -> set:
    return {m for m in [*getattr(model, "layers", []), *getattr(model, "coda", [])] if isinstance(m, FSDPModule)}


def reshard_looped_layers(model: torch.nn.Module) -> None:
    """Free the unsharded looped-layer parameters kept through backward (call after the last backward,
    before the optimizer step, so the next forward all-gathers the updated weights)."""
    for module in _looped(model):
        module.reshard()
