from titanloop.model.config import PRESETS, LoopLMConfig, preset
from titanloop.model.looplm import DecoderLayer, LoopLM, LoopLMOutput, LoopStep, RMSNorm, build_looplm

__all__ = [
    "LoopLM",
    "LoopLMConfig",
    "LoopLMOutput",
    "LoopStep",
    "DecoderLayer",
    "RMSNorm",
    "PRESETS",
    "preset",
    "build_looplm",
]
