"""RetrofitLM: a pretrained dense decoder cut into Prelude / one recurrent layer / Coda (ouroboros Algorithm 1).

    x = prelude(embed(tokens))                                         # frozen, once
    for t in 0..T-1:
        δ_t   = modulation(pool(x), t)          # controller | static | none -> one [.., r] diagonal per target
        h_new = layer_R(x; W_k + (α/r) B_k diag(δ_t,k) A_k)             # frozen W_k, A_k, B_k
        h_new = StepNorm_t(h_new)                                       # per-step RMSNorm (optional)
        x     = g*h_new + (1-g)*x,  g = sigmoid(W_g [h_new; x] + b_g)   # gated recurrence (optional)
    logits = lm_head(norm(coda(x)))                                     # frozen, once

The layers are the Hugging Face Qwen2/Llama pre-norm decoder layers (h += attn(ln1(h)); h += mlp(ln2(h)),
optional q/k/v/o/MLP biases) with the HF parameter names, so the import is a renaming of layer indices.

Low-rank application: the modulated projection is never materialized. For an input x of a target k,
    y = W_k x + b_k + (α/r) B_k (δ ⊙ (A_k x))
costs 2r(d_in + d_out) extra FLOPs per token and keeps one [B, S, r] activation (A_k x), instead of a
d_out x d_in matrix per sample (whole-sequence pooling) or per token (causal pooling). See docs/retrofit.md.

The forward returns a LoopLMOutput (titanloop.model) with the last step's readout only (the coda runs once),
so the trainer's `final_only` objective and statistics apply unchanged. The attribute names `prelude`,
`layers` (the recurrent layer) and `coda` let titanloop.parallel's FSDP2 / AC / compile plans wrap it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from titanloop.config_errors import require
from titanloop.model import LoopLMOutput, RMSNorm
from titanloop.model.attention import apply_rope, attention, document_mask, rope_cos_sin, rows_are_documents
from titanloop.retrofit.config import RetrofitConfig
from titanloop.retrofit.controller import build_modulation


@dataclass(frozen=True)
class DenseShape:
    """The dense model's shape, as read from its Hugging Face config (titanloop.retrofit.hf_import)."""

    vocab_size: int
    hidden_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    n_layers: int
    norm_eps: float
    rope_theta: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    tie_embeddings: bool
    max_seq_len: int

    def target_dims(self) -> dict[str, tuple[int, int]]:
        """(d_in, d_out) of each LoRA target's projection."""
        h, q, kv, f = (
            self.hidden_size,
            self.n_heads * self.head_dim,
            self.n_kv_heads * self.head_dim,
            self.ffn_hidden_size,
        )
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, f),
            "up_proj": (h, f),
            "down_proj": (f, h),
        }


class DenseAttention(nn.Module):
    def __init__(self, s: DenseShape):
        super().__init__()
        self.head_dim = s.head_dim
        self.q_proj = nn.Linear(s.hidden_size, s.n_heads * s.head_dim, bias=s.qkv_bias)
        self.k_proj = nn.Linear(s.hidden_size, s.n_kv_heads * s.head_dim, bias=s.qkv_bias)
        self.v_proj = nn.Linear(s.hidden_size, s.n_kv_heads * s.head_dim, bias=s.qkv_bias)
        self.o_proj = nn.Linear(s.n_heads * s.head_dim, s.hidden_size, bias=s.o_bias)

    def forward(self, x, cos, sin, mask, proj: Callable):
        b, n, _ = x.shape
        q = proj(self.q_proj, "q_proj", x).view(b, n, -1, self.head_dim).transpose(1, 2)
        k = proj(self.k_proj, "k_proj", x).view(b, n, -1, self.head_dim).transpose(1, 2)
        v = proj(self.v_proj, "v_proj", x).view(b, n, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attention(q, k, v, mask).transpose(1, 2).reshape(b, n, -1)
        return proj(self.o_proj, "o_proj", out)


class DenseMLP(nn.Module):
    def __init__(self, s: DenseShape):
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden_size, s.ffn_hidden_size, bias=s.mlp_bias)
        self.up_proj = nn.Linear(s.hidden_size, s.ffn_hidden_size, bias=s.mlp_bias)
        self.down_proj = nn.Linear(s.ffn_hidden_size, s.hidden_size, bias=s.mlp_bias)

    def forward(self, x, proj: Callable):
        return proj(
            self.down_proj, "down_proj", F.silu(proj(self.gate_proj, "gate_proj", x)) * proj(self.up_proj, "up_proj", x)
        )


def _plain(lin: nn.Linear, target: str, x: torch.Tensor) -> torch.Tensor:
    return lin(x)


class DenseLayer(nn.Module):
    """The Hugging Face Qwen2/Llama decoder layer (pre-norm). `proj(linear, target, x)` applies each of the
    seven projections; the recurrent layer passes one that adds the low-rank modulation."""

    def __init__(self, s: DenseShape):
        super().__init__()
        self.self_attn = DenseAttention(s)
        self.mlp = DenseMLP(s)
        self.input_layernorm = RMSNorm(s.hidden_size, s.norm_eps)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.norm_eps)

    def forward(self, h, cos, sin, mask=None, proj: Callable = _plain):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, mask, proj)
        return h + self.mlp(self.post_attention_layernorm(h), proj)


class LoRABases(nn.Module):
    """Frozen low-rank bases of the seven targets: A_k [r, d_in] and B_k [d_out, r] (ouroboros §3.2)."""

    def __init__(self, s: DenseShape, rank: int):
        super().__init__()
        for k, (d_in, d_out) in s.target_dims().items():
            require(
                rank <= min(d_in, d_out), "retrofit.lora_rank", rank, f"<= min(d_in, d_out) = {min(d_in, d_out)} of {k}"
            )
            self.register_parameter(f"{k}_A", nn.Parameter(torch.zeros(rank, d_in), requires_grad=False))
            self.register_parameter(f"{k}_B", nn.Parameter(torch.zeros(d_out, rank), requires_grad=False))

    def modulated(self, deltas: dict[str, torch.Tensor], scale: float) -> Callable:
        """proj(linear, target, x) = linear(x) + scale * B (delta ⊙ (A x)); delta broadcasts to [B, S, r]."""

        def proj(lin: nn.Linear, target: str, x: torch.Tensor) -> torch.Tensor:
            a = F.linear(x, getattr(self, f"{target}_A"))
            return lin(x) + scale * F.linear(a * deltas[target], getattr(self, f"{target}_B"))

        return proj

    def delta_weight(self, target: str, delta: torch.Tensor, scale: float) -> torch.Tensor:
        """The materialized ΔW = scale * B diag(delta) A (for tests and export checks only)."""
        return scale * getattr(self, f"{target}_B") @ torch.diag(delta) @ getattr(self, f"{target}_A")


class RetrofitLM(nn.Module):
    def __init__(self, shape: DenseShape, cfg: RetrofitConfig):
        super().__init__()
        cfg.validate()
        cfg.check_depth(shape.n_layers)
        self.shape, self.rcfg = shape, cfg
        d = shape.hidden_size
        self.embed_tokens = nn.Embedding(shape.vocab_size, d)
        self.prelude = nn.ModuleList(DenseLayer(shape) for _ in range(cfg.n_prelude))
        self.layers = nn.ModuleList([DenseLayer(shape)])  # the recurrent layer R (a list for the parallel plans)
        self.coda = nn.ModuleList(DenseLayer(shape) for _ in range(cfg.n_coda))
        self.norm = RMSNorm(d, shape.norm_eps)
        self.lm_head = nn.Linear(d, shape.vocab_size, bias=False)
        if shape.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        use_lora = cfg.modulation != "none"
        self.lora = LoRABases(shape, cfg.lora_rank) if use_lora else None
        self.modulation = build_modulation(cfg, d)
        self.recurrence_gate = nn.Linear(2 * d, d, bias=True) if cfg.gated_recurrence else None
        self.step_norms = (
            nn.ModuleList(RMSNorm(d, shape.norm_eps) for _ in range(cfg.max_loops)) if cfg.step_norm else None
        )
        self.loop_wrapper: Callable | None = None  # set by activation checkpointing mode "loop"
        self.compiled_layers = False  # set by titanloop.parallel.compile.apply_compile
        self.init_trainable()

    # ----- trainable extras and the frozen base -------------------------------------------------
    @torch.no_grad()
    def init_trainable(self) -> None:
        """Zero gate W and bias gate_bias_init, unit step norms, zero-init controller heads / static diagonals."""
        if self.recurrence_gate is not None:
            nn.init.zeros_(self.recurrence_gate.weight)
            nn.init.constant_(self.recurrence_gate.bias, self.rcfg.gate_bias_init)
        if self.step_norms is not None:
            for n in self.step_norms:
                n.reset_parameters()
        if self.modulation is not None:
            self.modulation.reset_parameters()

    def trainable_modules(self) -> dict[str, nn.Module]:
        mods = {"modulation": self.modulation, "recurrence_gate": self.recurrence_gate, "step_norms": self.step_norms}
        return {k: m for k, m in mods.items() if m is not None}

    def freeze_base(self) -> None:
        """requires_grad only on the controller / static diagonals, the gate and the step norms."""
        trainable = {id(p) for m in self.trainable_modules().values() for p in m.parameters()}
        for p in self.parameters():
            p.requires_grad_(id(p) in trainable)

    def param_counts(self) -> tuple[int, int]:
        """(trainable, frozen) unique parameters."""
        unique = {id(p): p for p in self.parameters()}.values()
        trainable = sum(p.numel() for p in unique if p.requires_grad)
        return trainable, sum(p.numel() for p in unique) - trainable

    # ----- forward ----------------------------------------------------------------------------
    def rope_and_mask(
        self,
        input_ids: torch.Tensor,
        *,
        doc_ids: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        host_doc_ids: torch.Tensor | None = None,
    ):
        """host_doc_ids: doc_ids in host memory, where the document boundaries are read without a device sync."""
        s = input_ids.shape[1]
        if positions is None:
            positions = torch.arange(s, device=input_ids.device)
        cos, sin = rope_cos_sin(positions, self.shape.head_dim, self.shape.rope_theta, self.embed_tokens.weight.dtype)
        mask = None  # also where every row is one document: plain causal attention, no per-document work
        if doc_ids is not None and not rows_are_documents(doc_ids, host_doc_ids, "auto", self.compiled_layers):
            mask = document_mask(
                doc_ids,
                "auto",
                self.embed_tokens.weight.dtype,
                graph_safe=getattr(self, "graph_safe_attention", False),  # set by apply_compile
                host_doc_ids=host_doc_ids,
            )
        return cos, sin, mask

    def recurrent_step(
        self, x: torch.Tensor, t: int, cos, sin, mask=None, doc_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """One recurrence step t (0-based): state x -> next state."""
        proj = _plain
        if self.modulation is not None:
            deltas = self.modulation(x, t, doc_ids)
            proj = self.lora.modulated(deltas, self.rcfg.lora_scale)
        h = self.layers[0](x, cos, sin, mask, proj)
        if self.step_norms is not None:
            h = self.step_norms[t](h)
        if self.recurrence_gate is not None:
            g = torch.sigmoid(self.recurrence_gate(torch.cat([h, x], dim=-1)))
            h = g * h + (1 - g) * x
        return h

    def forward(
        self,
        input_ids: torch.Tensor,
        n_loops: int | None = None,
        *,
        doc_ids: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        kv_cache=None,
        position_offset: int = 0,
        return_logits: str | None = None,
    ) -> LoopLMOutput:
        """input_ids [B, S] -> LoopLMOutput with one readout (the coda's normed output after T steps)."""
        require(
            kv_cache is None and position_offset == 0,
            "kv_cache",
            kv_cache,
            "None: the retrofit model has no incremental decoding (run the full sequence)",
        )
        t_total = self.rcfg.n_loops if n_loops is None else int(n_loops)
        require(t_total >= 1, "n_loops", n_loops, "an integer >= 1")
        host_doc_ids = None
        if doc_ids is not None and doc_ids.device != input_ids.device:  # e.g. the trainer's batch, on the host
            host_doc_ids, doc_ids = doc_ids, doc_ids.to(input_ids.device, non_blocking=True)
        if self.rcfg.step_norm or self.rcfg.modulation != "none":
            require(
                t_total <= self.rcfg.max_loops,
                "n_loops",
                t_total,
                f"<= max_loops={self.rcfg.max_loops} (per-step parameters; model.max_loops in a training config)",
            )
        cos, sin, mask = self.rope_and_mask(input_ids, doc_ids=doc_ids, positions=positions, host_doc_ids=host_doc_ids)
        x = self.embed_tokens(input_ids)
        for layer in self.prelude:
            x = layer(x, cos, sin, mask)
        step = self.recurrent_step if self.loop_wrapper is None else self.loop_wrapper(self.recurrent_step)
        states = []
        for t in range(t_total):
            x = step(x, t, cos, sin, mask, doc_ids)
            states.append(x)
        h = x
        for layer in self.coda:
            h = layer(h, cos, sin, mask)
        normed = self.norm(h)
        b, s = input_ids.shape
        out = LoopLMOutput(readouts=[normed], states=states, gate_logits=normed.new_zeros(1, b, s), next_input=x)
        if return_logits in ("last", "all"):
            out.logits = self.lm_head(normed)
            if return_logits == "all":
                out.logits = out.logits[None]
        elif return_logits is not None:
            require(False, "return_logits", return_logits, "None, 'last' or 'all'")
        return out

    def flops_per_token(self, seq_len: int, n_loops: int | None = None, training: bool = True) -> float:
        """Matmul FLOPs per token (the accounting of LoopLMConfig.flops_per_token): prelude and coda once, the
        recurrent layer and its low-rank terms T times, controller, gate, LM head. In training the frozen
        prelude runs forward only; coda, recurrent layer and LM head also pass input gradients back (x2, no
        weight gradients); the trained controller and gate count x3."""
        s, t = self.shape, self.rcfg.n_loops if n_loops is None else n_loops
        d = s.hidden_size
        layer = 2 * sum(a * b for a, b in s.target_dims().values()) + 2 * 2 * seq_len * s.n_heads * s.head_dim / 2
        lora = 2 * self.rcfg.lora_rank * sum(a + b for a, b in s.target_dims().values()) if self.lora else 0
        prelude = len(self.prelude) * layer
        frozen = (len(self.coda) + t) * layer + t * lora + 2 * d * s.vocab_size
        trained = t * 2 * 2 * d * d if self.recurrence_gate is not None else 0
        if self.modulation is not None:
            trained += t * self.modulation.flops_per_token()
        k = (1, 2, 3) if training else (1, 1, 1)
        return prelude * k[0] + frozen * k[1] + trained * k[2]
