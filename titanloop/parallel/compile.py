"""torch.compile of each decoder layer (the looped block's unit), in place.

Every loop calls the same layer modules with the same shapes, so Dynamo compiles each layer's forward
once and every further loop, and every other loop count T, reuses that graph (no recompilation: the loop
index never reaches the compiled code). On GPU with bf16 the attention inside the compiled layer is the
flash path (flash-attn or SDPA's flash kernel); on CPU it is SDPA. `nn.Module.compile` keeps parameter
names unchanged (no `_orig_mod.`), so checkpoints and the HF adapter are unaffected.
"""

from __future__ import annotations

from titanloop.model import LoopLM


def apply_compile(model: LoopLM, backend="inductor") -> None:
    """Compile every decoder layer of `model` (prelude, looped stack, coda) with `backend`."""
    for layer in [*model.prelude, *model.layers, *model.coda]:
        layer.compile(backend=backend, fullgraph=False, dynamic=False)


def compiled_graphs() -> int:
    """Graphs Dynamo has compiled in this process so far (every recompilation adds one)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
