"""Float8 training of the decoder layers' linears with torchao: the `[float8]` section (`recipe = "tensorwise" |
"rowwise"`), its checks and the conversion.

`apply_float8` swaps every nn.Linear of the decoder layers (prelude, looped stack, coda: q/k/v/o, gate/up/down) for
torchao's Float8Linear with `convert_to_float8_training`, before TP/AC/compile/FSDP2 (as torchtitan converts its
models before parallelizing them). The matmuls then run in float8 with dynamic scaling: one scale per tensor
("tensorwise", cuBLAS) or per row ("rowwise", CUTLASS; power-of-2 scales). Parameters, gradients, the optimizer
state and the checkpoints keep their dtypes: a Float8Linear holds the same fp32 `weight` as the nn.Linear it
replaces, so a float8 checkpoint resumes in bf16 and the reverse.

Left in high precision, as torchtitan does (it filters the output projection) and as OLMo-core does: the LM head
(its logits feed the softmax of every loop's CE: the most precision-sensitive matmul, and under TP a plain
replicated weight the chunked CE reads directly), the exit gate and the recurrence gate (1- or H-wide outputs:
nothing to gain, their sigmoid decides when to stop) and the embedding (a lookup, not a matmul). Linears with a
dimension that is not a multiple of 16 are left alone too (torch._scaled_mm needs it on the GPU).

Without a GPU (`emulate`), torchao emulates the float8 matmul in high precision with the same casts: the numerics
of the float8 recipe, not its speed.

FSDP2 float8 all-gather (tensorwise; torchao supports it for no other recipe): the weight becomes torchao's
WeightWithDynamicFloat8CastTensor; FSDP2 casts each shard to float8 before the all-gather (half the bytes of a bf16
all-gather) and the unsharded weight arrives as a float8 tensor, which Float8Linear uses as is, forward and
backward. With the looped stack gathered once per step (`parallelism.reshard_looped = "never"`) each looped weight
is then cast once per step, for all T loops, instead of 2T times (once per call in forward, once in backward; rowwise
and `reshard_looped = "always"` cast 2T times). `count_weight_casts` counts them; the trainer logs the count as
comm/float8_weight_cast with `metrics.count_comms`. `precompute_scales`, after each optimizer step, computes every
float8 weight's scale with one all-reduce for all weights, instead of one all-reduce per weight inside each
all-gather (the first step after a start or resume still does the latter; the scales are equal either way).
gloo (CPU) has no float8 dtype, but a decoder layer's FSDP2 unit also holds its RMSNorm weights, and FSDP2 packs
an all-gather of mixed dtypes as bytes (uint8), which gloo carries: the same float8 all-gather runs on CPU.
"""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from dataclasses import dataclass

import torch.nn as nn

from titanloop.config_errors import require, require_choice

RECIPES = ("off", "tensorwise", "rowwise")
FILTERS = ("all", "auto")


@dataclass
class Float8Section:
    """`[float8]`: float8 matmuls in the decoder layers' linears (torchao; LM head, gates and embedding stay in high
    precision), emulated without a GPU (docs/parallelism.md)."""

    recipe: str = "off"  # off | tensorwise | rowwise
    # which decoder linears: all (every one whose dimensions are multiples of 16) | auto (only those whose shapes
    # torchao's H100 tables show faster in float8: torchao's _auto_filter_for_recipe, torchtitan's
    # auto_filter_small_kn; for Ouro 1.4B rowwise keeps only gate/up, tensorwise keeps all)
    filter: str = "all"

    def validate(self) -> None:
        require_choice(self.recipe, "float8.recipe", RECIPES)
        require_choice(self.filter, "float8.filter", FILTERS)


def check_float8_layout(f8: Float8Section, engine: str, tp: int, family_has_float8: bool = True) -> None:
    """Where float8 runs (checked by titanloop.train.config before any process group): the FSDP2 engine, without
    tensor parallelism, on a model family that supports it (a LoopLM; not a retrofit run)."""
    if f8.recipe == "off":
        return
    require(
        family_has_float8,
        "float8.recipe",
        f8.recipe,
        "'off' for a retrofit run (retrofit.hf_path is set; its frozen pretrained base is not converted)",
    )
    require(
        engine == "fsdp2",
        "float8.recipe",
        f8.recipe,
        f"'off' with parallelism.engine={engine!r} (float8 is built for engine='fsdp2' only)",
    )
    require(
        tp == 1,
        "float8.recipe",
        f8.recipe,
        f"'off' with parallelism.tp={tp} (float8 with tensor parallelism is not supported yet: use parallelism.tp=1)",
    )


def float8_config(recipe: str, *, emulate: bool):
    """torchao's Float8LinearConfig for `recipe` ('tensorwise' | 'rowwise'); tensorwise with FSDP2 float8 all-gather."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(config, emulate=emulate, enable_fsdp_float8_all_gather=recipe == "tensorwise")


def _converts(module: nn.Module, fqn: str) -> bool:
    return isinstance(module, nn.Linear) and module.in_features % 16 == 0 and module.out_features % 16 == 0


def apply_float8(model: nn.Module, recipe: str, *, emulate: bool, compile: bool = False, filter: str = "all") -> int:
    """Swap the decoder layers' linears of `model` (a LoopLM, possibly on the meta device) for Float8Linear in place;
    returns how many were swapped. recipe 'off' does nothing; filter: see Float8Section."""
    if recipe == "off":
        return 0
    # torchtitan refuses the same combination (its emulation is for eager tests only)
    require(
        not (emulate and compile),
        "float8.recipe",
        recipe,
        "'off' with parallelism.compile=true without a GPU (torchao's float8 emulation runs eager only)",
    )
    from torchao.float8 import convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    config = float8_config(recipe, emulate=emulate)
    converts = _converts
    if filter == "auto":
        from torchao.float8.float8_linear_utils import _auto_filter_for_recipe

        converts = _auto_filter_for_recipe(recipe, filter_fqns=[])
    for stack in (model.prelude, model.layers, model.coda):
        convert_to_float8_training(stack, module_filter_fn=converts, config=config)
    if config.enable_fsdp_float8_all_gather:
        model._register_state_dict_hook(_plain_weights)
    return sum(isinstance(m, Float8Linear) for m in model.modules())


def _plain_weights(module, state_dict, prefix, local_metadata) -> None:
    """state_dict hook: the float8-all-gather weights as the plain tensors they wrap (the same storage), so that
    checkpoints hold plain fp32 tensors, which a run without float8 (or without torchao imported) loads."""
    from torch.distributed.tensor import DTensor
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    for key, value in list(state_dict.items()):
        local = value._local_tensor if isinstance(value, DTensor) else value
        if not isinstance(local, WeightWithDynamicFloat8CastTensor):
            continue
        plain = local._tensor
        if isinstance(value, DTensor):
            plain = DTensor.from_local(
                plain, value.device_mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride()
            )
        state_dict[key] = plain


def float8_summary(model: nn.Module, recipe: str) -> str:
    """One line for the dry run: what was converted and how the weights are all-gathered."""
    from torchao.float8.float8_linear import Float8Linear

    f8 = [m for m in model.modules() if isinstance(m, Float8Linear)]
    linears = sum(isinstance(m, nn.Linear) for m in model.modules())
    params = sum(m.weight.numel() for m in f8)
    gather = (
        "float8 all-gather (1 cast per weight per step with parallelism.reshard_looped='never')"
        if uses_float8_all_gather(model)
        else "high-precision all-gather, cast in every matmul"
    )
    return (
        f"float8 {recipe}: {len(f8)} of {linears} linears converted ({params / 1e9:.3f}B weights; LM head, gates "
        f"and embedding stay high precision), {gather}"
    )


def uses_float8_all_gather(model: nn.Module) -> bool:
    if "torchao.float8" not in sys.modules:  # float8 off: do not import torchao (slow, and it warns on import)
        return False
    from torchao.float8.float8_linear import Float8Linear

    return any(isinstance(m, Float8Linear) and m.config.enable_fsdp_float8_all_gather for m in model.modules())


def precompute_scales(model: nn.Module) -> None:
    """After the optimizer step: every float8-all-gathered weight's scale from its updated shards, with one
    all-reduce for all of them (torchao's precompute_float8_dynamic_scale_for_fsdp); no-op without such weights."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)


@contextlib.contextmanager
def count_weight_casts():
    """with count_weight_casts() as casts: ...  -> casts["float8_weight_cast"] is how many times a weight was cast to
    float8 inside the block (Float8Linear's forward and backward, and FSDP2's pre-all-gather hook). Counts Python
    calls: eager mode only (a compiled graph calls the cast without passing through Python)."""
    from torchao.float8 import float8_scaling_utils, fsdp_utils
    from torchao.float8.float8_training_tensor import GemmInputRole

    counts: Counter = Counter()
    patched = [(mod, mod.hp_tensor_and_scale_to_float8) for mod in (float8_scaling_utils, fsdp_utils)]

    def wrap(cast):
        def counted(
            hp_tensor, s, float8_dtype, linear_mm_config=None, gemm_input_role=GemmInputRole.INPUT, axiswise_dim=None
        ):
            if gemm_input_role is GemmInputRole.WEIGHT:
                counts["float8_weight_cast"] += 1
            return cast(hp_tensor, s, float8_dtype, linear_mm_config, gemm_input_role, axiswise_dim)

        return counted

    for mod, cast in patched:
        mod.hp_tensor_and_scale_to_float8 = wrap(cast)
    try:
        yield counts
    finally:
        for mod, cast in patched:
            mod.hp_tensor_and_scale_to_float8 = cast
