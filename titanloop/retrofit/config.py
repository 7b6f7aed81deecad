"""How a pretrained dense checkpoint becomes Prelude / one recurrent layer / Coda (ouroboros §3): the `[retrofit]`
section (RetrofitSection) and the model's own config (RetrofitConfig: the section plus the loop settings).

Plain data (no torch import). The base model's shape is not repeated here: it comes from the checkpoint's
config.json, read with transformers' own config classes (`titanloop.retrofit.hf_import.read_hf_config`).

    layers 0 .. P-1          prelude   (frozen, run once)
    layer  R                 recurrent (frozen weights, looped T times, modulated by frozen LoRA bases)
    layers L-C .. L-1        coda      (frozen, run once on the last state)
    the other middle layers  removed   (their mean residual vs layer R seeds the LoRA bases, §3.2)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from titanloop.config_errors import from_dict_strict, require, require_choice

MODULATIONS = ("controller", "static", "none")
POOLINGS = ("causal", "sequence")
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


LOOP_KEYS = ("max_loops", "gated_recurrence", "gate_bias_init")  # loop settings whose home is [model]


@dataclass
class RetrofitSection:
    """`[retrofit]` of a training config: which checkpoint, how it is cut and how the recurrent layer is modulated.
    The loop settings are not here: T is `[loop_sampler] n_loops`, and max_loops, gated_recurrence and
    gate_bias_init are `[model]` keys (their one home for either model family); `RetrofitConfig` adds them."""

    hf_path: str = ""  # local Hugging Face directory (config.json + *.safetensors), Qwen2 or Llama layout
    n_prelude: int = 8  # P
    recurrent_layer: int = 18  # R (0-based index in the dense model)
    n_coda: int = 8  # C
    # controller: CompactController hypernetwork (input-dependent diagonals, Algorithm 1)
    # static: a learned diagonal per step and target (the paper's static per-step LoRA baseline)
    # none: no LoRA modulation at all
    modulation: str = "controller"
    lora_rank: int = 32  # r
    lora_alpha: float = 16.0  # ΔW = (alpha / r) B diag(delta) A
    style_dim: int = 128  # s: controller width (Proj: d -> 2s, StyleNet: 3s -> 2s -> s, heads: s -> r)
    # causal: position i pools h_1..h_i of its own document (no future tokens; KV-cacheable)
    # sequence: the paper's mean over the whole document (sees future tokens; see docs/retrofit.md)
    pooling: str = "causal"
    step_norm: bool = True  # a distinct RMSNorm on each step's new state, before the gate (§3.5)

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        require(self.n_prelude >= 0, "retrofit.n_prelude", self.n_prelude, "an integer >= 0")
        require(self.n_coda >= 0, "retrofit.n_coda", self.n_coda, "an integer >= 0")
        require(
            self.recurrent_layer >= self.n_prelude,
            "retrofit.recurrent_layer",
            self.recurrent_layer,
            f"an index >= n_prelude={self.n_prelude} (the recurrent layer comes after the prelude)",
        )
        require_choice(self.modulation, "retrofit.modulation", MODULATIONS)
        require_choice(self.pooling, "retrofit.pooling", POOLINGS)
        require(self.lora_rank >= 1, "retrofit.lora_rank", self.lora_rank, "an integer >= 1")
        require(self.style_dim >= 1, "retrofit.style_dim", self.style_dim, "an integer >= 1")


@dataclass
class RetrofitConfig(RetrofitSection):
    """The retrofit model's own config (what RetrofitLM, its export and its checkpoints read): the section plus the
    loop settings, which a training run fills from `[loop_sampler] n_loops` and `[model]`."""

    n_loops: int = 1  # T: default recurrence steps per forward (the trainer's loop sampler may override per call)
    max_loops: int = 16  # per-step norms / step embeddings / static diagonals exist for t < max_loops
    gated_recurrence: bool = True  # h = g*StepNorm(h_new) + (1-g)*h, g = sigmoid(W[h_new; h] + b)
    gate_bias_init: float = -2.0  # sigmoid(-2) = 0.12: retain 88% of the previous state at init

    def validate(self) -> None:
        super().validate()
        require(self.n_loops >= 1, "n_loops", self.n_loops, "an integer >= 1")
        require(
            self.max_loops >= self.n_loops,
            "max_loops",
            self.max_loops,
            f"an integer >= n_loops={self.n_loops}",
        )

    @classmethod
    def for_run(cls, section: RetrofitSection, n_loops: int, loop_settings: dict) -> "RetrofitConfig":
        """The model config of a training run: its [retrofit] section, T, and the [model] loop keys it sets."""
        return cls(**dataclasses.asdict(section), n_loops=n_loops, **loop_settings)

    def check_depth(self, n_layers: int) -> None:
        """The split against the dense model's depth L (known once its config.json is read)."""
        require(
            self.recurrent_layer < n_layers - self.n_coda,
            "retrofit.recurrent_layer",
            self.recurrent_layer,
            f"an index < L - n_coda = {n_layers} - {self.n_coda} (the base model has L={n_layers} layers)",
        )

    def removed_layers(self, n_layers: int) -> list[int]:
        """Middle layers that are dropped (their mean residual vs layer R seeds the LoRA bases)."""
        return [i for i in range(self.n_prelude, n_layers - self.n_coda) if i != self.recurrent_layer]

    def kept_layers(self, n_layers: int) -> list[int]:
        """Dense layer indices in retrofit order: prelude, the recurrent layer, coda."""
        return [*range(self.n_prelude), self.recurrent_layer, *range(n_layers - self.n_coda, n_layers)]

    @property
    def lora_scale(self) -> float:
        return self.lora_alpha / self.lora_rank

    def replace(self, **changes) -> "RetrofitConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "RetrofitConfig":
        return from_dict_strict(cls, d, "retrofit config")
