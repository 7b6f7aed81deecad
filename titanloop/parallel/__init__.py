"""Parallelism for the LoopLM, applied from outside the model (as torchtitan does for its models):
tensor parallelism (tensor_parallel.py), activation checkpointing (activation_checkpoint.py), per-layer
torch.compile (compile.py), FSDP2 (fsdp.py), put together by parallelize_looplm (parallelize.py);
comm_count.py counts the collectives of one training step. See docs/parallelism.md."""

from titanloop.parallel.activation_checkpoint import apply_activation_checkpointing
from titanloop.parallel.comm_count import count_collectives
from titanloop.parallel.compile import apply_compile
from titanloop.parallel.fsdp import apply_fsdp, reshard_looped_layers, set_gradient_sync
from titanloop.parallel.parallelize import gather_sequence, parallelize_looplm
from titanloop.parallel.tensor_parallel import apply_tensor_parallel

__all__ = [
    "apply_activation_checkpointing",
    "apply_compile",
    "apply_fsdp",
    "apply_tensor_parallel",
    "count_collectives",
    "gather_sequence",
    "parallelize_looplm",
    "reshard_looped_layers",
    "set_gradient_sync",
]
