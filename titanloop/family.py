"""Model families: everything the trainer needs to know about the model it trains, in one place per family.

The trainer (config checks, startup, dry run, memory plan, metrics, run summary) never asks which model it
trains: it asks the run's family, `family_of(model, retrofit, n_loops)` (TrainConfig.family), in the spirit of
torchtitan's ModelSpec. A family is built from its own sections, never from the whole training config:

    name                          "looplm" | "retrofit"
    reads_out_every_loop          whether every loop decodes (held-out validation per loop needs it)
    float8                        whether [float8] is built for it
    shape                         the LoopLMConfig-shaped view of the model (vocabulary, heads, widths, layers) at
                                  the run's default depth: what the layout checks, the data pipeline and the
                                  memory plan read
    build(load_weights)           the nn.Module: a LoopLM on the meta device (build_engine allocates each rank's
                                  shards); a retrofit loads its pretrained base (on meta from config.json only
                                  with load_weights=False, for the dry run)
    check_layout(tp=, engine=, objective=, jsrr_weight=, loops=)
                                  what the family supports beyond the generic checks (one-line ConfigError)
    flops_per_token(seq_len, n_loops, doc_lengths, backward_loops, unread_loops)
                                  training FLOPs per token, every loop that runs counted (the backward of the
                                  last backward_loops only, under truncation; unread_loops more after the last,
                                  with a graph, not decoded): tokens/s -> TFLOPs -> MFU
    describe()                    the model's name in the run summary and the dry run
    extra_summary(run)            lines the run summary adds for this family
    export(model, out_dir)        the Hugging Face writer (its state-dict adapter): Ouro HF for a LoopLM,
                                  the retrofit's own model_type for a retrofit

Two families: `LoopLMFamily` (titanloop.model, from `[model]`) and `RetrofitFamily` (titanloop.retrofit, from
`[retrofit]` and the loop keys of `[model]`; chosen by `retrofit.hf_path`).

The loop count T has one home for both, `[loop_sampler] n_loops`: `family_of` gets it and builds the model at that
default depth; `trained_depth(loop_sampler)` is what checkpoints record.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from titanloop.config_errors import require
from titanloop.interchange.ouro_hf import export_ouro_hf
from titanloop.model import LoopLM
from titanloop.model.config import LoopLMConfig, ModelSection
from titanloop.objectives import LoopSamplerConfig
from titanloop.retrofit.config import LOOP_KEYS, RetrofitConfig, RetrofitSection
from titanloop.retrofit.export import export_hf
from titanloop.retrofit.hf_import import load_retrofit, looplm_view, read_hf_config
from titanloop.retrofit.model import RetrofitLM


def trained_depth(sampler: LoopSamplerConfig) -> dict:
    """The loop count a run trains at, as checkpoints record it (titanloop.json "trained_depth"): the sampler's
    kind, its range [min, max], and `n_loops`, the default depth for inference (the fixed T; for a sampled T, the
    sampler's n_loops)."""
    lo, hi = sampler.bounds()
    return {"kind": sampler.kind, "n_loops": sampler.n_loops, "min": lo, "max": hi}


class LoopLMFamily:
    """Ouro-style LoopLM: prelude, N shared layers looped T times, exit gate, one LM head (titanloop.model)."""

    name = "looplm"
    reads_out_every_loop = True  # per-loop readouts (held-out validation scores every loop)
    float8 = True  # [float8] converts its decoder layers

    def __init__(self, model: ModelSection, n_loops: int):
        require(
            n_loops <= model.max_loops,
            "loop_sampler.n_loops",
            n_loops,
            f"<= model.max_loops={model.max_loops} (the deepest loop a LoopLM runs; raise model.max_loops)",
        )
        self.section, self.n_loops = model, n_loops
        self.shape: LoopLMConfig = model.shape(n_loops)

    def build(self, load_weights: bool = True) -> nn.Module:
        with torch.device("meta"):
            return LoopLM(self.shape)

    def check_layout(self, *, tp: int, engine: str, objective: str, jsrr_weight: float, loops: tuple) -> None:
        if self.shape.per_loop_norm:
            require(
                loops[1] <= self.shape.max_loops,
                "loop_sampler.max_sampled",
                loops[1],
                f"<= model.max_loops={self.shape.max_loops} (per_loop_norm has one norm per loop)",
            )

    def flops_per_token(
        self,
        seq_len: int,
        n_loops: int,
        doc_lengths: list[int] | None = None,
        backward_loops: int | None = None,
        unread_loops: int = 0,
    ) -> float:
        return self.shape.flops_per_token(
            seq_len, n_loops=n_loops, doc_lengths=doc_lengths, backward_loops=backward_loops, unread_loops=unread_loops
        )

    def describe(self) -> str:
        return self.section.describe(self.n_loops)

    def extra_summary(self, run) -> list[str]:
        return []

    def export(self, model: nn.Module, out_dir, **kwargs):
        return export_ouro_hf(model, out_dir, **kwargs)


class RetrofitFamily:
    """Ouroboros retrofit: a pretrained Qwen2/Llama checkpoint as prelude / one looped layer / coda, base frozen
    (titanloop.retrofit). Its shape is read from the checkpoint's config.json."""

    name = "retrofit"
    reads_out_every_loop = False  # the coda decodes the last recurrence step only
    float8 = False  # its frozen pretrained base is not converted
    _meta_models: dict[str, nn.Module] = {}  # FLOP counting needs the built shape, not the weights

    def __init__(self, retrofit: RetrofitSection, model: ModelSection, n_loops: int):
        self.shape_keys = {k: v for k, v in model.overrides.items() if k not in LOOP_KEYS}  # refused: check_layout
        loop_settings = {k: model.overrides[k] for k in LOOP_KEYS if k in model.overrides}
        max_loops = loop_settings.get("max_loops", RetrofitConfig.max_loops)
        require(
            n_loops <= max_loops,
            "loop_sampler.n_loops",
            n_loops,
            f"<= model.max_loops={max_loops} (per-step norms, embeddings and diagonals)",
        )
        self.config = RetrofitConfig.for_run(retrofit, n_loops, loop_settings)

    @property
    def shape(self) -> LoopLMConfig:
        return looplm_view(self.config)

    def build(self, load_weights: bool = True) -> nn.Module:
        if load_weights:
            return load_retrofit(self.config)
        with torch.device("meta"):  # the dry run: the shape from config.json only
            model = RetrofitLM(read_hf_config(self.config.hf_path)[1], self.config)
        model.freeze_base()
        return model

    def check_layout(self, *, tp: int, engine: str, objective: str, jsrr_weight: float, loops: tuple) -> None:
        """What a retrofit run supports: its shape comes from the HF checkpoint, it decodes only the last recurrence
        step, and its per-step parameters bound the loop count."""
        r = self.config
        require(
            not self.shape_keys,
            "model",
            self.shape_keys,
            f"no [model] keys but {', '.join(LOOP_KEYS)} in a retrofit run (the shape comes from "
            "retrofit.hf_path's config.json)",
        )
        r.check_depth(read_hf_config(r.hf_path)[1].n_layers)
        require(tp == 1, "parallelism.tp", tp, "1 for a retrofit run (its model has no tensor-parallel plan)")
        require(
            engine == "fsdp2",
            "parallelism.engine",
            engine,
            "'fsdp2' for a retrofit run (the DeepSpeed engine is not built or tested for a frozen pretrained base)",
        )
        require(
            objective == "final_only",
            "objective.name",
            objective,
            "'final_only' for a retrofit run (the coda decodes the last recurrence step only)",
        )
        require(jsrr_weight == 0, "objective.jsrr_weight", jsrr_weight, "0 for a retrofit run")
        require(
            loops[1] <= r.max_loops,
            "loop_sampler",
            loops[1],
            f"at most model.max_loops={r.max_loops} loops (per-step norms, embeddings and diagonals)",
        )

    def flops_per_token(
        self,
        seq_len: int,
        n_loops: int,
        doc_lengths: list[int] | None = None,
        backward_loops: int | None = None,
        unread_loops: int = 0,
    ) -> float:
        """RetrofitLM's own count: the frozen prelude runs forward only, the frozen coda, recurrent layer and LM
        head pass input gradients back, the controller and gate train (RetrofitLM.flops_per_token). Attention
        is counted over the whole sequence (the retrofit has no packed-document FLOP count)."""
        key = repr(self.config)
        if key not in self._meta_models:
            self._meta_models[key] = self.build(load_weights=False)
        return self._meta_models[key].flops_per_token(seq_len, n_loops=n_loops, training=True)

    def describe(self) -> str:
        return "RetrofitLM (base frozen)"

    def extra_summary(self, run) -> list[str]:
        return [
            f"retrofit of {self.config.hf_path}: {run.n_trainable:,} trainable parameters, "
            f"{run.n_params - run.n_trainable:,} frozen | modulation {self.config.modulation}"
        ]

    def export(self, model: nn.Module, out_dir, **kwargs):
        return export_hf(model, out_dir)


def family_of(model: ModelSection, retrofit: RetrofitSection, n_loops: int) -> LoopLMFamily | RetrofitFamily:
    """The run's model family at default depth T = n_loops: a retrofit when `retrofit.hf_path` is set, else a
    LoopLM. One-line ConfigError when its sections cannot make that model (e.g. T above max_loops)."""
    if retrofit.hf_path:
        return RetrofitFamily(retrofit, model, n_loops)
    return LoopLMFamily(model, n_loops)
