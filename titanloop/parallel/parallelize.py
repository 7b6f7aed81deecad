"""parallelize_looplm: float8, TP, AC, compile and FSDP2 applied to a LoopLM from outside the model
(titanloop.train.engines).

Order (as in torchtitan, which converts to float8 when it builds the model, then runs its llama3 parallelize):
float8 linears -> tensor parallel -> activation checkpointing -> compile -> FSDP2.
Meshes come from torchtitan's ParallelDims: "fsdp" (data parallel, always present) and "tp".

FSDP2 is applied when it has work to do (`needs_fsdp`): more than one data-parallel rank, mixed precision (FSDP2's
policy computes in bf16 from fp32 master weights) or float8 all-gathers. A one-rank fp32 run (a CPU run of one
process) trains the plain module, as torchtitan does on one device: on a one-rank mesh FSDP2's hooks, parameter
copies and DTensor dispatch cost a third of a small model's step and compute the same numbers.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from titanloop.model import LoopLM
from titanloop.parallel.activation_checkpoint import apply_activation_checkpointing
from titanloop.parallel.compile import apply_compile
from titanloop.parallel.float8 import apply_float8
from titanloop.parallel.fsdp import apply_fsdp
from titanloop.parallel.tensor_parallel import apply_tensor_parallel


def parallelize_looplm(
    model: LoopLM,
    *,
    parallel_dims,
    tp_mesh: DeviceMesh | None = None,
    sequence_parallel: bool = True,
    activation_checkpoint: str = "none",
    ac_kept_loops: int = 0,
    compile: bool = False,
    compile_backend="inductor",
    param_dtype=torch.float32,
    reduce_dtype=torch.float32,
    reshard_looped: str = "never",
    compile_fullgraph: bool | None = None,
    float8: str = "off",
    float8_emulate: bool = False,
    float8_filter: str = "all",
) -> LoopLM:
    """Apply float8 (float8.recipe, titanloop.parallel.float8), TP (when parallel_dims.tp > 1), AC, compile and
    FSDP2 to `model` in place and return it. compile_fullgraph: see apply_compile (None: as the attention backend
    allows)."""
    apply_float8(model, float8, emulate=float8_emulate, compile=compile, filter=float8_filter)
    if parallel_dims.tp_enabled:
        apply_tensor_parallel(model, tp_mesh or parallel_dims.get_mesh("tp"), sequence_parallel)
    apply_activation_checkpointing(model, activation_checkpoint, ac_kept_loops)
    if compile:
        apply_compile(model, compile_backend, compile_fullgraph)
    dp_mesh = parallel_dims.get_mesh("fsdp")
    if needs_fsdp(dp_mesh.size(), parallel_dims.tp, param_dtype, reduce_dtype, float8):
        apply_fsdp(model, dp_mesh, param_dtype, reduce_dtype, reshard_looped)
    return model


def needs_fsdp(dp: int, tp: int, param_dtype: torch.dtype, reduce_dtype: torch.dtype, float8: str) -> bool:
    """Whether FSDP2 wraps the model (module docstring): sharding over dp > 1 ranks, a tensor-parallel mesh to
    compose with, mixed precision (param_dtype below fp32) or float8 weights; not a one-rank fp32 run."""
    return dp > 1 or tp > 1 or param_dtype != torch.float32 or reduce_dtype != torch.float32 or float8 != "off"


def gather_sequence(x: torch.Tensor, tp_mesh: DeviceMesh | None, seq_dim: int = 1) -> torch.Tensor:
    """The full sequence from each tp rank's local slice (differentiable; identity without tp).

    Backward hands each rank the gradient of its own slice, which is right because every tp rank
    evaluates the same loss on the gathered tensor.
    """
    if tp_mesh is None:
        return x
    return DTensor.from_local(x, tp_mesh, [Shard(seq_dim)], run_check=False).full_tensor()
