"""Ouroboros retrofit: a pretrained dense Qwen2/Llama checkpoint as Prelude / one recurrent layer / Coda,
with frozen SVD-initialized LoRA bases, a CompactController hypernetwork (or static per-step diagonals),
gated recurrence and per-step norms; only those extras train (ouroboros-controller paper, docs/retrofit.md).

Modules: config (RetrofitSection, RetrofitConfig), model (RetrofitLM), controller (CompactController, static baseline,
pooling), hf_import (local HF checkpoint -> RetrofitLM, SVD bases), export (own HF model_type + remote code).
"""

from titanloop.retrofit.config import LOOP_KEYS, MODULATIONS, POOLINGS, TARGETS, RetrofitConfig, RetrofitSection

__all__ = ["LOOP_KEYS", "MODULATIONS", "POOLINGS", "RetrofitConfig", "RetrofitSection", "TARGETS"]
