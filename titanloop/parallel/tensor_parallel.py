"""Tensor parallelism (Megatron column/row split) plus sequence parallelism for the LoopLM.

Per decoder layer (prelude, looped stack and coda alike; the looped layers are planned once and reused
by every loop):

    q/k/v_proj, gate/up_proj   ColwiseParallel      (heads / FFN columns split over tp)
    o_proj, down_proj          RowwiseParallel      (partial sums reduced: all-reduce, or reduce-scatter
                                                     onto the sequence with sequence parallelism)
    the 4 sandwich RMSNorms    SequenceParallel     (the residual stream is split over the sequence)

With sequence parallelism (`sequence_parallel=True`) the residual stream between sub-blocks is the local
[B, S/tp, H] slice; self_attn and mlp all-gather it to the full sequence on entry (PrepareModuleInput)
and reduce-scatter it on exit. The embedding is RowwiseParallel over the vocabulary with a sequence-
sharded output; the final norm, exit gate, recurrence gate and per-loop norms are per-token maps and run
as SequenceParallel modules (their weights are replicated DTensors whose gradients are summed over tp).

The LM head stays a plain replicated weight: titanloop.objectives.chunked_ce takes it as a tensor. The
trainer gathers the per-loop readouts to the full sequence (gather_sequence in parallelize.py), so every
tp rank evaluates the same objective and gets the same (complete) LM-head gradient without extra comms.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from titanloop.config_errors import require
from titanloop.model import LoopLM

# The oldest torch whose DTensor runs the per-token linears (exit gate, recurrence gate) on the sequence-sharded
# residual stream. torch 2.11 decomposes a 3-D nn.Linear into a view that flattens the sharded sequence dimension and
# fails in the first forward ("Attempted to flatten multiple dimensions, with dimension 1 being sharded"); 2.12, 2.13
# and the pinned 2.14.1 train debug.toml at tp = 2 (checked on the CPU, 2026-11-29).
TP_MIN_TORCH = (2, 12)


def check_tp_torch(tp: int) -> None:
    """One-line ConfigError when `tp` > 1 and the installed torch is older than TP_MIN_TORCH."""
    version = torch.__version__
    major_minor = tuple(int(x) for x in version.split("+")[0].split(".")[:2])
    need = ".".join(map(str, TP_MIN_TORCH))
    require(
        tp == 1 or major_minor >= TP_MIN_TORCH,
        "parallelism.tp",
        tp,
        f"1 with torch {version}: tensor parallelism needs torch >= {need} (install the pinned torch 2.14.1: "
        "bash scripts/setup.sh)",
    )


def _layer_plan(sequence_parallel: bool) -> dict:
    plan = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
    }
    if not sequence_parallel:
        plan["self_attn.o_proj"] = RowwiseParallel()
        plan["mlp.down_proj"] = RowwiseParallel()
        return plan
    plan.update(
        {
            "input_layernorm": SequenceParallel(use_local_output=True),
            "input_layernorm_2": SequenceParallel(use_local_output=True),
            "post_attention_layernorm": SequenceParallel(use_local_output=True),
            "post_attention_layernorm_2": SequenceParallel(use_local_output=True),
            # Attention.forward(x, cos, sin, mask, cache): only x is sharded; gather it to the full sequence.
            "self_attn": PrepareModuleInput(
                input_layouts=(Shard(1), None, None, None, None),
                desired_input_layouts=(Replicate(), None, None, None, None),
                use_local_output=True,
            ),
            "mlp": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
            ),
            "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
            "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
        }
    )
    return plan


def apply_tensor_parallel(model: LoopLM, tp_mesh: DeviceMesh, sequence_parallel: bool = True) -> None:
    """Shard `model` in place over the 1-D `tp_mesh` (see the module docstring for the plan)."""
    top: dict = {
        "embed_tokens": RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1) if sequence_parallel else Replicate()
        )
    }
    if sequence_parallel:
        top["norm"] = SequenceParallel(use_local_output=True)
        top["early_exit_gate"] = SequenceParallel(use_local_output=True)
        if model.recurrence_gate is not None:
            top["recurrence_gate"] = SequenceParallel(use_local_output=True)
        if model.loop_norms is not None:
            for i in range(len(model.loop_norms)):
                top[f"loop_norms.{i}"] = SequenceParallel(use_local_output=True)
    parallelize_module(model, tp_mesh, top)
    for layer in [*model.prelude, *model.layers, *model.coda]:
        parallelize_module(layer, tp_mesh, _layer_plan(sequence_parallel))
