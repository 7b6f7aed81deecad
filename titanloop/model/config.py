"""LoopLM configuration, named size presets, parameter and FLOP counts.

A LoopLM is a stack of `n_layers` decoder layers applied `n_loops` times with shared weights
(RECIPE §1). Everything here is plain data: no torch import, so configs can be built and validated
before any process group or device exists.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from titanloop.config_errors import ConfigError, from_dict_strict, require, require_choice
from titanloop.config_fields import coerce, field_types

READOUTS = ("norm", "raw", "final_only_norm")
INJECTIONS = ("add", "diagonal")
INIT_STATES = ("embedding", "random")
BLOCK_NORMS = ("sandwich", "pre")  # see titanloop.model.looplm.DecoderLayer
ATTENTION_BACKENDS = ("auto", "varlen", "flash", "flex", "sdpa_per_doc", "sdpa")  # see titanloop.model.attention


@dataclass
class LoopLMConfig:
    vocab_size: int = 49152
    hidden_size: int = 2048
    n_heads: int = 16
    n_kv_heads: int | None = None  # None -> n_heads (MHA, as Ouro); fewer -> GQA
    ffn_hidden_size: int = 5632
    n_layers: int = 24  # layers in the shared (looped) stack
    n_loops: int = 4  # default T when forward() is not told otherwise
    max_loops: int = 16  # upper bound for per-loop parameters (per-loop norms) and sweeps
    max_seq_len: int = 65536
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    init_std: float = 0.02
    # std of the token embedding at init (None: init_std, as Ouro). With the sandwich norm every sublayer adds a
    # unit-RMS update to the residual stream, so an embedding of RMS 0.02 is ~2% of the state after the first
    # sublayer; 1.0 puts the token on par with the updates (docs/training.md, "Embedding scale").
    embed_init_std: float | None = None
    # dropout probability, in training only (model.train()): on the embedding and on each sublayer's output before
    # it joins the residual stream, as nanoGPT's (which also drops attention weights; titanloop's fused attention
    # kernels do not). 0: no dropout module at all.
    dropout: float = 0.0

    # Variants (all off by default; the defaults reproduce Ouro).
    readout: str = "norm"  # norm | raw | final_only_norm  (readout-blind-spot §3)
    inter_loop_norm: bool = True  # feed norm(h_t) (True, Ouro) or raw h_t (False) into the next loop
    # add the token embedding (after the prelude) to every later loop's input, x_t + e: input injection as in
    # recurrent-depth models (Geiping et al. concatenate it instead). Keeps the token a constant share of what each
    # loop reads while the raw state grows; T = 1 is unchanged (docs/training.md, "Seed dependence").
    inject_embedding: bool = False
    # how inject_embedding injects: add (x_t + e) or diagonal, Parcae's stable injection x_t <- A x_t + B e with A, B
    # per-channel and A = exp(-softplus(dt) * exp(A_log)) in (0, 1), so its spectral radius is < 1 by construction
    injection: str = "add"
    # what the first loop starts from: the embedding (Ouro) or, as Huginn, a random state drawn from a normal of
    # std init_state_std (null: the embedding's init std) into which the embedding is injected (needs
    # inject_embedding); docs/training.md, "Depth that holds"
    init_state: str = "embedding"
    init_state_std: float | None = None
    n_prelude_layers: int = 0  # layers run once before the loop (STARS / Huginn)
    n_coda_layers: int = 0  # layers run on each loop's state before its readout
    gated_recurrence: bool = False  # h = g*h_new + (1-g)*h_old, g = sigmoid(W[h_new;h_old]+b)
    gate_bias_init: float = -2.0
    per_loop_norm: bool = False  # a distinct RMSNorm for each loop step (ouroboros §3.5)
    # the decoder layer: "sandwich" (Ouro) norms each sublayer's input and output, h += norm'(f(norm(h))), which
    # bounds every update's RMS by the output norm's gains; "pre" norms the input only, h += f(norm(h)), so the
    # residual stream can grow without bound (readout-blind-spot §3)
    block_norm: str = "sandwich"
    tie_embeddings: bool = False

    # auto: documents through torch's varlen_attn on CUDA fp16/bf16 (flash-attn, FlexAttention as fallbacks),
    # dense mask or per-document SDPA on CPU; the table is in titanloop.model.attention
    attention_backend: str = "auto"
    # RoPE positions restart at every packed document (off: 0..S-1 per row; equal attention under the document
    # mask since RoPE is relative, so this changes only rounding; see titanloop.model.attention)
    rope_per_document: bool = False

    def __post_init__(self):
        self.validate()

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.n_heads

    def validate(self) -> None:
        for name in ("vocab_size", "hidden_size", "n_heads", "ffn_hidden_size", "n_layers", "max_seq_len"):
            require(int(getattr(self, name)) >= 1, name, getattr(self, name), "an integer >= 1")
        require(self.n_loops >= 1, "n_loops", self.n_loops, "an integer >= 1 (T, the number of loops)")
        require(self.max_loops >= self.n_loops, "max_loops", self.max_loops, f"an integer >= n_loops={self.n_loops}")
        require(
            self.hidden_size % self.n_heads == 0,
            "n_heads",
            self.n_heads,
            f"a divisor of hidden_size={self.hidden_size}",
        )
        require(
            (self.hidden_size // self.n_heads) % 2 == 0,
            "n_heads",
            self.n_heads,
            f"a value making head_dim=hidden_size/n_heads even (RoPE); hidden_size={self.hidden_size}",
        )
        require(
            1 <= self.kv_heads <= self.n_heads and self.n_heads % self.kv_heads == 0,
            "n_kv_heads",
            self.n_kv_heads,
            f"a divisor of n_heads={self.n_heads} (or null for MHA)",
        )
        require(self.rope_theta > 0, "rope_theta", self.rope_theta, "a positive RoPE base")
        require(self.norm_eps > 0, "norm_eps", self.norm_eps, "a positive float")
        require(
            self.embed_init_std is None or self.embed_init_std > 0,
            "embed_init_std",
            self.embed_init_std,
            "a positive std (or null for init_std)",
        )
        require(
            self.embed_init_std is None or not self.tie_embeddings,
            "embed_init_std",
            self.embed_init_std,
            "null when tie_embeddings = true (the tied LM head would start at that scale too)",
        )
        require(0 <= self.dropout < 1, "dropout", self.dropout, "a probability in [0, 1)")
        require_choice(self.readout, "readout", READOUTS)
        require_choice(self.injection, "injection", INJECTIONS)
        require_choice(self.init_state, "init_state", INIT_STATES)
        require(
            self.injection == "add" or self.inject_embedding,
            "injection",
            self.injection,
            "'add' unless inject_embedding = true (it says how the embedding is injected)",
        )
        require(
            self.init_state == "embedding" or self.inject_embedding,
            "init_state",
            self.init_state,
            "'embedding' unless inject_embedding = true (a random initial state sees the tokens only through the "
            "injection)",
        )
        require(
            self.init_state_std is None or self.init_state_std > 0,
            "init_state_std",
            self.init_state_std,
            "a positive std (or null for the embedding's init std)",
        )
        require_choice(self.block_norm, "block_norm", BLOCK_NORMS)
        require_choice(self.attention_backend, "attention_backend", ATTENTION_BACKENDS)
        require(self.n_prelude_layers >= 0, "n_prelude_layers", self.n_prelude_layers, "an integer >= 0")
        require(self.n_coda_layers >= 0, "n_coda_layers", self.n_coda_layers, "an integer >= 0")

    def replace(self, **changes) -> "LoopLMConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "LoopLMConfig":
        return from_dict_strict(cls, d, "model config")

    # ----- parameter and FLOP accounting -------------------------------------------------------
    def layer_params(self) -> int:
        h, kv = self.hidden_size, self.kv_heads * self.head_dim
        attn = h * h * 2 + h * kv * 2  # q, o and k, v (no biases)
        mlp = 3 * h * self.ffn_hidden_size
        norms = (4 if self.block_norm == "sandwich" else 2) * h  # RMSNorm weights per layer
        return attn + mlp + norms

    def param_count(self, include_embedding: bool = True) -> int:
        """Unique (stored) parameters: looping reuses the same weights, so T does not change this."""
        h = self.hidden_size
        n = self.layer_params() * (self.n_layers + self.n_prelude_layers + self.n_coda_layers)
        n += h  # final norm
        n += h + 1  # exit gate
        if self.gated_recurrence:
            n += 2 * h * h + h
        if self.per_loop_norm:
            n += self.max_loops * h
        if self.inject_embedding and self.injection == "diagonal":
            n += 3 * h  # A_log, dt, B
        head = self.vocab_size * h
        if include_embedding:
            n += head  # embedding
            if not self.tie_embeddings:
                n += head
        elif not self.tie_embeddings:
            n += head  # the LM head is a matmul per token, count it as compute-bearing
        return n

    def flops_per_token(
        self,
        seq_len: int,
        n_loops: int | None = None,
        readouts: int | None = None,
        training: bool = True,
        doc_lengths=None,
        backward_loops: int | None = None,
        unread_loops: int = 0,
    ) -> float:
        """Model FLOPs per token: THE count behind MFU in the training metrics, the benchmarks and gpu_check.

        Matmuls only (the standard 6N + attention accounting, PaLM appendix B), with attention counted over
        the keys each query actually attends to: (S + 1) / 2 on average under the causal mask, or, with
        packed-document masking, sum L(L+1)/2 / sum L over `doc_lengths` (the documents' lengths, e.g.
        DocumentMask.doc_lengths). This is what flash kernels compute (they skip masked blocks); a kernel
        that computes the full square does more work than this counts.

        Loops count: the shared stack's matmuls and attention run `n_loops` times. `readouts` is how
        many loops are decoded by the LM head (all of them in per-loop training; default n_loops); coda
        layers run once per decoded loop. training=True counts forward+backward (x3 of forward), False
        counts the forward only. Checked against torch.utils.flop_counter in tests/test_model_flops.py.

        backward_loops: k < n_loops counts truncated backpropagation through depth as it runs: the forward of all
        n_loops loops (their coda layers and exit gates too) and the backward (x2 of forward) of the last k only,
        plus the prelude's; only the k loops with a graph are decoded (default `readouts` = k).

        unread_loops: loops run after the last one, with a graph, that are neither decoded nor gated (the
        fixed-point penalty's one more loop, LoopLM.loop_change): the shared stack only, forward and backward.
        """
        t = self.n_loops if n_loops is None else n_loops
        k = t if backward_loops is None else max(1, min(int(backward_loops), t))
        extra = unread_loops * self._loop_flops(seq_len, doc_lengths) * (3 if training else 1)
        if k == t:
            readouts = t if readouts is None else readouts
            return self._forward_flops(seq_len, t, readouts, readouts, doc_lengths) * (3 if training else 1) + extra
        readouts = k if readouts is None else readouts
        fwd = self._forward_flops(seq_len, t, readouts, t, doc_lengths)
        if not training:
            return fwd + extra
        return fwd + 2 * self._forward_flops(seq_len, k, readouts, k, doc_lengths) + extra

    def _layer_flops(self, seq_len: int, doc_lengths) -> float:
        """Forward FLOPs per token of one decoder layer: its matmuls and attention over the attended keys."""
        h = self.hidden_size
        kv = self.kv_heads * self.head_dim
        per_layer = 2 * (2 * h * h + 2 * h * kv + 3 * h * self.ffn_hidden_size)  # fwd matmul flops
        return per_layer + 2 * 2 * h * attended_keys_per_token(seq_len, doc_lengths)  # QK^T and AV

    def _loop_flops(self, seq_len: int, doc_lengths) -> float:
        """Forward FLOPs per token of one application of the shared stack (and the recurrence gate)."""
        gate = 2 * 2 * self.hidden_size**2 if self.gated_recurrence else 0
        return self.n_layers * self._layer_flops(seq_len, doc_lengths) + gate

    def _forward_flops(self, seq_len: int, t: int, readouts: int, coda_runs: int, doc_lengths) -> float:
        """Forward FLOPs per token of t loops, `readouts` of them decoded, the coda run `coda_runs` times."""
        h = self.hidden_size
        fwd = t * self._loop_flops(seq_len, doc_lengths)
        fwd += (self.n_prelude_layers + self.n_coda_layers * coda_runs) * self._layer_flops(seq_len, doc_lengths)
        fwd += readouts * 2 * h * self.vocab_size  # shared LM head at every decoded loop
        fwd += t * 2 * h  # exit gate
        return fwd


def attended_keys_per_token(seq_len: int, doc_lengths=None) -> float:
    """Mean number of keys a query attends to under the causal mask: (S + 1) / 2, or with document masking
    sum L(L+1)/2 / sum L over the packed documents' lengths `doc_lengths`."""
    if doc_lengths is None:
        return (seq_len + 1) / 2
    lengths = [int(n) for n in doc_lengths]
    require(lengths and min(lengths) >= 1, "doc_lengths", lengths, "a non-empty list of positive document lengths")
    return sum(n * (n + 1) for n in lengths) / (2 * sum(lengths))


def _ouro(n_layers: int) -> LoopLMConfig:
    return LoopLMConfig(
        vocab_size=49152,
        hidden_size=2048,
        n_heads=16,
        ffn_hidden_size=5632,
        n_layers=n_layers,
        n_loops=4,
        max_seq_len=65536,
        rope_theta=10000.0,
        norm_eps=1e-6,
    )


PRESETS = {
    # Published Ouro shapes (RECIPE §1): 24 layers = 1.4B, 48 layers = 2.6B, both T = 4.
    "ouro-1.4b": lambda: _ouro(24),
    "ouro-2.6b": lambda: _ouro(48),
    # Tiny sizes that train on a CPU in seconds.
    "debug-tiny": lambda: LoopLMConfig(
        vocab_size=512,
        hidden_size=64,
        n_heads=4,
        ffn_hidden_size=176,
        n_layers=2,
        n_loops=4,
        max_loops=16,
        max_seq_len=2048,
    ),
    "debug-small": lambda: LoopLMConfig(
        vocab_size=2048,
        hidden_size=128,
        n_heads=4,
        ffn_hidden_size=344,
        n_layers=4,
        n_loops=4,
        max_loops=16,
        max_seq_len=4096,
    ),
}


def preset(name: str, **overrides) -> LoopLMConfig:
    """A named size preset with optional field overrides, e.g. preset('debug-tiny', n_loops=2)."""
    if name not in PRESETS:
        raise ConfigError(f"model preset={name!r} is unknown: expected one of {sorted(PRESETS)}")
    cfg = PRESETS[name]()
    return cfg.replace(**overrides) if overrides else cfg


@dataclass
class ModelSection:
    """The `[model]` table of a training config: `preset` names a size in PRESETS; every other key overrides a
    LoopLMConfig field of it, except `n_loops`: the loop count T has one home, `[loop_sampler] n_loops`, and
    `shape(T)` is the model at that default depth."""

    preset: str = "debug-tiny"
    overrides: dict = dataclasses.field(default_factory=dict)
    named: bool = True  # False: the [model] table gave no preset (every field not set is debug-tiny's)

    def __post_init__(self):
        require_choice(self.preset, "model.preset", sorted(PRESETS))
        require("n_loops" not in self.overrides, "model.n_loops", self.overrides.get("n_loops"), _T_HOME)
        self.shape(1)  # every field checked once, at any depth the loop sampler may give

    def shape(self, n_loops: int) -> LoopLMConfig:
        """The LoopLMConfig of this section with default depth T = n_loops (the loop sampler's)."""
        return preset(self.preset, **self.overrides, n_loops=n_loops)

    @property
    def max_loops(self) -> int:
        return self.overrides.get("max_loops", PRESETS[self.preset]().max_loops)

    def to_dict(self) -> dict:
        return {"preset": self.preset, **self.overrides}

    @classmethod
    def from_table(cls, values: dict) -> "ModelSection":
        values = dict(values)
        named = "preset" in values
        name = values.pop("preset", cls.preset)
        if not isinstance(name, str):
            raise ConfigError(f"model.preset={name!r} is invalid: expected one of {sorted(PRESETS)}")
        types = {k: t for k, t in field_types(LoopLMConfig).items() if k != "n_loops"}
        unknown = sorted(set(values) - set(types))
        if unknown:
            raise ConfigError(
                f"[model] has unknown key(s) {unknown}: allowed keys are ['preset', "
                f"{', '.join(repr(k) for k in sorted(types))}]"
            )
        return cls(
            preset=name, overrides={k: coerce(v, types[k], f"model.{k}") for k, v in values.items()}, named=named
        )

    def describe(self, n_loops: int) -> str:
        """The model as the run summary names it: the preset only when the table named one and kept its shape
        (layers, widths, heads, vocabulary), then the shape itself."""
        m = self.shape(n_loops)
        shape = (
            f"{m.n_layers} shared layer(s) x T={n_loops}, hidden {m.hidden_size}, {m.n_heads} heads, "
            f"FFN {m.ffn_hidden_size}, vocab {m.vocab_size}"
        )
        reshaped = sorted(set(self.overrides) & set(SHAPE_FIELDS))
        if self.named and not reshaped:
            return f"LoopLM {self.preset} ({shape})"
        return f"LoopLM ({shape})"


SHAPE_FIELDS = ("vocab_size", "hidden_size", "n_heads", "n_kv_heads", "ffn_hidden_size", "n_layers")


_T_HOME = "no value here: the loop count T has one home, [loop_sampler] n_loops"
