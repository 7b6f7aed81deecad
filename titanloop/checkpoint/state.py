"""What goes into a checkpoint, split so that nothing read back can execute code.

Every state (model, optimizer, LR schedule, data loader, train counters, ...) is a nested state_dict. It is
split into its tensors, saved with torch.distributed.checkpoint (reshardable: DCP records each tensor's
global shape and re-slices on load), and a JSON skeleton with the rest (ints, floats, strings, lists),
stored in the manifest. Floats round-trip exactly through JSON (repr), so a resumed LR schedule or loss
history is bitwise the same.

RNG states are per rank: rank r's torch CPU/CUDA generators and Python/NumPy RNGs are saved as tensors under
`rng/rank<r>/...`; on resume at another world size, ranks that have no saved state keep their fresh seeding.
"""

from __future__ import annotations

import random

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from titanloop.config_errors import ConfigError

SEP = "/"


class ModelState:
    """A bare nn.Module as a checkpointable state (FQN keys; works for DDP/FSDP-wrapped modules)."""

    def __init__(self, model: nn.Module):
        self.model = model

    def state_dict(self) -> dict:
        return get_model_state_dict(self.model)

    def load_state_dict(self, sd: dict) -> None:
        set_model_state_dict(self.model, sd, options=StateDictOptions(strict=True))


class OptimizerState:
    """A bare torch.optim.Optimizer as a checkpointable state, keyed by parameter FQN (reshardable)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer
        self.options = StateDictOptions(flatten_optimizer_state_dict=True)

    def state_dict(self) -> dict:
        return get_optimizer_state_dict(self.model, self.optimizer, options=self.options)

    def load_state_dict(self, sd: dict) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, sd, options=self.options)


# ----- nested state_dict <-> (flat tensors, JSON skeleton) ----------------------------------------------
def split_state(obj, prefix: str, tensors: dict):
    """Return the JSON skeleton of obj; its tensors go into `tensors` under '/'-joined paths."""
    if isinstance(obj, torch.Tensor):
        tensors[prefix] = obj
        return {"__tensor__": prefix}
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            return {k: split_state(v, f"{prefix}{SEP}{k}", tensors) for k, v in obj.items()}
        for k in obj:
            if not isinstance(k, (str, int, float, bool)) and k is not None:
                raise ConfigError(
                    f"checkpoint state {prefix!r} has a key {k!r} of type {type(k).__name__}: "
                    "keys must be str/int/float/bool"
                )
        return {"__items__": [[k, split_state(v, f"{prefix}{SEP}{k}", tensors)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": [split_state(v, f"{prefix}{SEP}{i}", tensors) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [split_state(v, f"{prefix}{SEP}{i}", tensors) for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise ConfigError(
        f"checkpoint state {prefix!r} holds a {type(obj).__name__}: only tensors, dicts, lists, "
        "tuples, numbers, strings and None can be checkpointed"
    )


def join_state(skeleton, tensors: dict):
    """Inverse of split_state: rebuild the nested state from its skeleton and the loaded tensors."""
    if isinstance(skeleton, dict):
        if "__tensor__" in skeleton:
            return tensors[skeleton["__tensor__"]]
        if "__items__" in skeleton:
            return {k: join_state(v, tensors) for k, v in skeleton["__items__"]}
        if "__tuple__" in skeleton:
            return tuple(join_state(v, tensors) for v in skeleton["__tuple__"])
        return {k: join_state(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [join_state(v, tensors) for v in skeleton]
    return skeleton


def tensor_paths(skeleton) -> list[str]:
    out = []
    if isinstance(skeleton, dict):
        if "__tensor__" in skeleton:
            return [skeleton["__tensor__"]]
        children = (
            (v for _, v in skeleton["__items__"])
            if "__items__" in skeleton
            else (skeleton["__tuple__"] if "__tuple__" in skeleton else skeleton.values())
        )
        for v in children:
            out += tensor_paths(v)
    elif isinstance(skeleton, list):
        for v in skeleton:
            out += tensor_paths(v)
    return out


# ----- per-rank RNG states as tensors ----------------------------------------------------------------
def rng_state_tensors(rank: int) -> dict[str, torch.Tensor]:
    """This rank's RNG states as tensors keyed `rng/rank<r>/<generator>` (no pickled objects)."""
    p = f"rng{SEP}rank{rank}{SEP}"
    version, mt, gauss = random.getstate()
    out = {
        p + "torch_cpu": torch.get_rng_state(),
        p + "python_mt": torch.tensor(mt, dtype=torch.int64),
        p + "python_meta": torch.tensor([version, float("nan") if gauss is None else gauss], dtype=torch.float64),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            out[p + f"torch_cuda{i}"] = s
    try:
        import numpy as np
    except ImportError:
        return out
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    out[p + "numpy_mt"] = torch.from_numpy(keys.astype("int64"))
    out[p + "numpy_meta"] = torch.tensor([pos, has_gauss, cached], dtype=torch.float64)
    return out


def restore_rng_state(tensors: dict[str, torch.Tensor], rank: int) -> None:
    p = f"rng{SEP}rank{rank}{SEP}"
    torch.set_rng_state(tensors[p + "torch_cpu"])
    meta = tensors[p + "python_meta"].tolist()
    random.setstate((int(meta[0]), tuple(tensors[p + "python_mt"].tolist()), None if meta[1] != meta[1] else meta[1]))
    cuda = sorted(k for k in tensors if k.startswith(p + "torch_cuda"))
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([tensors[k] for k in cuda])
    if p + "numpy_mt" in tensors:
        import numpy as np

        pos, has_gauss, cached = tensors[p + "numpy_meta"].tolist()
        np.random.set_state(
            ("MT19937", tensors[p + "numpy_mt"].numpy().astype("uint32"), int(pos), int(has_gauss), cached)
        )
