"""Model families: everything the trainer needs to know about the model it trains, in one place per family.

The trainer (config checks, startup, dry run, memory plan, metrics, run summary) never asks which model it
trains: it asks the run's family, `family_of(cfg)`, in the spirit of torchtitan's ModelSpec:

    name                          "looplm" | "retrofit"
    reads_out_every_loop          whether every loop decodes (held-out validation per loop needs it)
    float8                        whether training.float8 is built for it
    shape(cfg)                    the LoopLMConfig-shaped view of the model (vocabulary, heads, widths, layers):
                                  what the layout checks, the data pipeline and the memory plan read
    build(cfg, load_weights)      the nn.Module: a LoopLM on the meta device (build_engine allocates each rank's
                                  shards); a retrofit loads its pretrained base (on meta from config.json only
                                  with load_weights=False, for the dry run)
    check_layout(cfg, tp, loops)  what the family supports beyond the generic checks (one-line ConfigError)
    flops_per_token(cfg, seq_len, n_loops, doc_lengths)
                                  training FLOPs per token, every loop counted: tokens/s -> TFLOPs -> MFU
    describe(cfg)                 the model's name in the run summary and the dry run
    extra_summary(cfg, run)       lines the run summary adds for this family
    export(model, out_dir)        the Hugging Face writer (its state-dict adapter): Ouro HF for a LoopLM,
                                  the retrofit's own model_type for a retrofit

Two entries: `LOOPLM` (titanloop.model) and `RETROFIT` (titanloop.retrofit, chosen by `retrofit.hf_path`).

The loop count T has one home for both: `[loop_sampler] n_loops` (titanloop.train.config); the model's default
depth is derived from it when a run starts, and `trained_depth(cfg)` is what checkpoints record.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from titanloop.config_errors import require
from titanloop.interchange.ouro_hf import export_ouro_hf
from titanloop.model import LoopLM
from titanloop.model.config import LoopLMConfig
from titanloop.retrofit.export import export_hf
from titanloop.retrofit.hf_import import load_retrofit, looplm_view, read_hf_config
from titanloop.retrofit.model import RetrofitLM

if TYPE_CHECKING:  # only for annotations: the train config imports this module
    from titanloop.train.config import TrainConfig


def trained_depth(cfg: "TrainConfig") -> dict:
    """The loop count a run trains at, as checkpoints record it (titanloop.json "trained_depth"): the sampler's
    kind, its range [min, max], and `n_loops`, the default depth for inference (the fixed T; for a sampled T, the
    sampler's n_loops)."""
    lo, hi = cfg.loop_sampler.bounds()
    return {"kind": cfg.loop_sampler.kind, "n_loops": cfg.loop_sampler.n_loops, "min": lo, "max": hi}


class LoopLMFamily:
    """Ouro-style LoopLM: prelude, N shared layers looped T times, exit gate, one LM head (titanloop.model)."""

    name = "looplm"
    reads_out_every_loop = True  # per-loop readouts (held-out validation scores every loop)
    float8 = True  # training.float8 converts its decoder layers

    def shape(self, cfg: "TrainConfig") -> LoopLMConfig:
        return cfg.model.looplm

    def build(self, cfg: "TrainConfig", load_weights: bool = True) -> nn.Module:
        with torch.device("meta"):
            return LoopLM(cfg.model.looplm)

    def check_layout(self, cfg: "TrainConfig", tp: int, max_loops: int) -> None:
        m = cfg.model.looplm
        t = cfg.loop_sampler.n_loops
        require(
            t <= m.max_loops,
            "loop_sampler.n_loops",
            t,
            f"<= model.max_loops={m.max_loops} (the deepest loop a LoopLM runs; raise model.max_loops)",
        )
        if m.per_loop_norm:
            require(
                max_loops <= m.max_loops,
                "loop_sampler.max_sampled",
                max_loops,
                f"<= model.max_loops={m.max_loops} (per_loop_norm has one norm per loop)",
            )

    def flops_per_token(
        self, cfg: "TrainConfig", seq_len: int, n_loops: int, doc_lengths: list[int] | None = None
    ) -> float:
        return cfg.model.looplm.flops_per_token(seq_len, n_loops=n_loops, doc_lengths=doc_lengths)

    def describe(self, cfg: "TrainConfig") -> str:
        return f"LoopLM {cfg.model.preset}"

    def extra_summary(self, cfg: "TrainConfig", run) -> list[str]:
        return []

    def export(self, model: nn.Module, out_dir, **kwargs):

        return export_ouro_hf(model, out_dir, **kwargs)


class RetrofitFamily:
    """Ouroboros retrofit: a pretrained Qwen2/Llama checkpoint as prelude / one looped layer / coda, base frozen
    (titanloop.retrofit). Its shape is read from the checkpoint's config.json."""

    name = "retrofit"
    reads_out_every_loop = False  # the coda decodes the last recurrence step only
    float8 = False  # its frozen pretrained base is not converted

    def __init__(self):
        self._meta_models: dict[tuple, nn.Module] = {}  # FLOP counting needs the built shape, not the weights

    def shape(self, cfg: "TrainConfig") -> LoopLMConfig:
        return looplm_view(cfg.retrofit)

    def build(self, cfg: "TrainConfig", load_weights: bool = True) -> nn.Module:
        if load_weights:
            return load_retrofit(cfg.retrofit)
        with torch.device("meta"):  # the dry run: the shape from config.json only
            model = RetrofitLM(read_hf_config(cfg.retrofit.hf_path)[1], cfg.retrofit)
        model.freeze_base()
        return model

    def check_layout(self, cfg: "TrainConfig", tp: int, max_loops: int) -> None:
        """What a retrofit run supports: its shape comes from the HF checkpoint, it decodes only the last recurrence
        step, and its per-step parameters bound the loop count."""
        r = cfg.retrofit
        require(
            not cfg.model.overrides,
            "model",
            cfg.model.overrides,
            "no [model] keys in a retrofit run (the shape comes from retrofit.hf_path's config.json)",
        )
        r.check_depth(read_hf_config(r.hf_path)[1].n_layers)
        require(tp == 1, "parallelism.tp", tp, "1 for a retrofit run (its model has no tensor-parallel plan)")
        require(
            cfg.parallelism.engine == "fsdp2",
            "parallelism.engine",
            cfg.parallelism.engine,
            "'fsdp2' for a retrofit run (the DeepSpeed engine is not built or tested for a frozen pretrained base)",
        )
        require(
            cfg.objective.name == "final_only",
            "objective.name",
            cfg.objective.name,
            "'final_only' for a retrofit run (the coda decodes the last recurrence step only)",
        )
        require(
            cfg.objective.jsrr_weight == 0, "objective.jsrr_weight", cfg.objective.jsrr_weight, "0 for a retrofit run"
        )
        require(
            max_loops <= r.max_loops,
            "loop_sampler",
            max_loops,
            f"at most retrofit.max_loops={r.max_loops} loops (per-step norms, embeddings and diagonals)",
        )

    def flops_per_token(
        self, cfg: "TrainConfig", seq_len: int, n_loops: int, doc_lengths: list[int] | None = None
    ) -> float:
        """RetrofitLM's own count: the frozen prelude runs forward only, the frozen coda, recurrent layer and LM
        head pass input gradients back, the controller and gate train (RetrofitLM.flops_per_token). Attention
        is counted over the whole sequence (the retrofit has no packed-document FLOP count)."""
        key = (cfg.retrofit.hf_path, repr(cfg.retrofit))
        if key not in self._meta_models:
            self._meta_models[key] = self.build(cfg, load_weights=False)
        return self._meta_models[key].flops_per_token(seq_len, n_loops=n_loops, training=True)

    def describe(self, cfg: "TrainConfig") -> str:
        return "RetrofitLM (base frozen)"

    def extra_summary(self, cfg: "TrainConfig", run) -> list[str]:
        return [
            f"retrofit of {cfg.retrofit.hf_path}: {run.n_trainable:,} trainable parameters, "
            f"{run.n_params - run.n_trainable:,} frozen | modulation {cfg.retrofit.modulation}"
        ]

    def export(self, model: nn.Module, out_dir, **kwargs):
        return export_hf(model, out_dir)


LOOPLM = LoopLMFamily()
RETROFIT = RetrofitFamily()
FAMILIES = {f.name: f for f in (LOOPLM, RETROFIT)}


def family_of(cfg: "TrainConfig"):
    """The run's model family: a retrofit when `retrofit.hf_path` is set, else a LoopLM."""
    return RETROFIT if cfg.retrofit.hf_path else LOOPLM
