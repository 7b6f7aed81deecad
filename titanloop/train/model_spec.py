"""The LoopLM registered as a torchtitan 0.3.0 model: a ModelSpec with a parallelize_fn and an HF adapter.

torchtitan's `BaseModel` protocol wants every submodule to be a torchtitan `Module` built from nested
Configs; the LoopLM is a plain nn.Module (and stays one: titanloop.model is framework-free). The thin
adapter here is `LoopLMModel.Config`, a `BaseModel.Config` that carries a LoopLMConfig, builds the plain
LoopLM, reports parameters and FLOPs (counting loops), and is what `ModelSpec.model` holds. torchtitan's
components that only need `model_parts` (optimizers, LR schedulers, checkpointing, grad clipping) work
on the LoopLM unchanged.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from torchtitan.protocols.model import BaseModel
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.protocols.state_dict_adapter import StateDictAdapter

from titanloop.model import LoopLM, LoopLMConfig
from titanloop.parallel import parallelize_looplm


class LoopLMModel(BaseModel):
    """Owner of the LoopLM model config in torchtitan's Configurable registry (never instantiated:
    `Config.build()` returns a plain titanloop LoopLM)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseModel.Config):
        looplm: LoopLMConfig = field(default_factory=LoopLMConfig)
        flops_loops: int | None = None  # loops counted in FLOPs/token (None: looplm.n_loops)

        def build(self, **kwargs) -> LoopLM:
            return LoopLM(self.looplm)

        def update_from_config(self, *, config, **kwargs) -> None:
            """Take the loop count from the titanloop training config (used for FLOPs/MFU)."""
            sampler = getattr(config, "loop_sampler", None)
            if sampler is not None and sampler.kind == "fixed":
                self.flops_loops = sampler.n_loops

        def get_nparams_and_flops(self, model, seq_len: int) -> tuple[int, int]:
            n_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
            return n_params, int(self.looplm.flops_per_token(seq_len, n_loops=self.flops_loops))

        def to_dict(self) -> dict:
            return {"looplm": self.looplm.to_dict(), "flops_loops": self.flops_loops}


def _hf_name(name: str) -> str:
    return name if name.startswith("lm_head.") else f"model.{name}"


class LoopLMStateDictAdapter(StateDictAdapter):
    """titanloop parameter names <-> the Ouro Hugging Face names (RECIPE §1).

    The LoopLM already uses Ouro's module names and the rotate_half RoPE layout, so the mapping is the
    `model.` prefix (the LM head excepted); a tied LM head is not stored, as in Hugging Face.
    """

    def __init__(self, model_config: LoopLMModel.Config, hf_assets_path: str | None):
        super().__init__(model_config, hf_assets_path)
        self.tied = model_config.looplm.tie_embeddings

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return {_hf_name(k): v for k, v in state_dict.items() if not (self.tied and k == "lm_head.weight")}

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        out = {re.sub(r"^model\.", "", k): v for k, v in hf_state_dict.items()}
        if self.tied and "embed_tokens.weight" in out:
            out["lm_head.weight"] = out["embed_tokens.weight"]
        return out


def looplm_model_spec(cfg: LoopLMConfig, flavor: str = "custom") -> ModelSpec:
    """The torchtitan ModelSpec of a LoopLM of shape `cfg` (flavor: the preset name)."""
    return ModelSpec(name="looplm", flavor=flavor, model=LoopLMModel.Config(looplm=cfg),
                     parallelize_fn=parallelize_looplm, pipelining_fn=None, post_optimizer_build_fn=None,
                     state_dict_adapter=LoopLMStateDictAdapter)
