"""Seeded initialization that gives the same full weights whatever the sharding.

Every parameter gets its own generator, seeded from (seed, parameter name), and is drawn in full on the
parameter's device, then only this rank's shard is kept. So a model built on the meta device, parallelized
(FSDP2 / TP DTensors) and materialized with `materialize(model, device, seed)` holds exactly the shards of
the model `LoopLM(cfg)` would build in full from the same seed, at any world size and layout, while no rank
ever holds more than one full parameter at a time (the largest: the embedding). The rule per parameter
(normal with which std, or a constant) is `LoopLM.init_rule`.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

# Wrappers that parallel plans put around modules and that must not change a parameter's identity.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def canonical_name(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def draw_seed() -> int:
    """A base seed from torch's global RNG (so `torch.manual_seed(s)` before a build fixes the weights)."""
    return int(torch.randint(0, 2**62, (), device="cpu"))


def _fill(full: torch.Tensor, rule: tuple[str, float], seed: int, name: str) -> None:
    kind, value = rule
    if kind == "const":
        full.fill_(value)
        return
    gen = torch.Generator(device=full.device).manual_seed((seed + zlib.crc32(name.encode())) % 2**63)
    full.normal_(0.0, value, generator=gen)


@torch.no_grad()
def init_parameters(model: nn.Module, seed: int | None = None) -> None:
    """Initialize every parameter of a (possibly wrapped and sharded) LoopLM per `model.init_rule`.

    Plain tensors are filled in place; a DTensor (FSDP2 / TP shard) gets the slice of the full tensor its
    placements give this rank. Meta tensors are left alone (nothing to fill yet)."""
    if all(p.device.type == "meta" for p in model.parameters()):
        return  # built on the meta device: `materialize` initializes after parallelization
    seed = draw_seed() if seed is None else seed
    root = model
    seen: set[int] = set()
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for pname, param in module.named_parameters(recurse=False):
            if id(param) in seen:  # tied weights: initialized once, under their first name
                continue
            seen.add(id(param))
            if param.device.type == "meta":
                continue
            name = canonical_name(f"{mod_name}.{pname}" if mod_name else pname)
            rule = root.init_rule(module, name)
            if isinstance(param, DTensor):
                full = torch.empty(param.shape, dtype=param.dtype, device=param.to_local().device)
                _fill(full, rule, seed, name)
                shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
                param.to_local().copy_(shard.to_local())
            else:
                _fill(param.data, rule, seed, name)


def materialize(model: nn.Module, device: torch.device | str, seed: int | None = None) -> None:
    """Allocate a meta-built (and parallelized) model's local shards on `device` and initialize them from
    `seed` (default: the seed the LoopLM drew when it was built, so `torch.manual_seed(s)` before building on
    the meta device gives the weights `torch.manual_seed(s); LoopLM(cfg)` has). Tied parameters stay tied:
    `to_empty` gives each owner of a plain (unsharded) meta parameter a new parameter of its own, so every
    extra owner of a shared one gets its first owner's back."""
    owners: dict[int, list] = {}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append((module, name))
    model.to_empty(device=device)
    for (first, first_name), *others in (o for o in owners.values() if len(o) > 1):
        for module, name in others:
            setattr(module, name, getattr(first, first_name))
    init_parameters(model, model.init_seed if seed is None else seed)
