"""The LoopLM: N shared decoder layers applied T times, an exit gate and one LM head after every loop.

Read top to bottom: RMSNorm, Attention, MLP, DecoderLayer (sandwich norm, or pre-norm), LoopLM.

    x = embed(tokens); x = prelude(x)
    for t in 1..T:
        h_t   = layers(x)                          # the shared stack, same weights every loop
        h_t   = g*h_t + (1-g)*x  (gated recurrence, optional)
        r_t   = readout(h_t)                       # norm(h_t) | h_t | raw-then-norm-at-T
        λ_t   = sigmoid(exit_gate(norm(h_t)))      # one scalar per token per loop
        x     = norm(h_t) if inter_loop_norm else h_t
        x     = x + e  (inject_embedding: e is the embedded, pre-loop input)
                or A x + B e  (injection='diagonal': Parcae's stable injection, 0 < A < 1 per channel)

With init_state='random' (Huginn) the first loop starts from noise with the embedding injected, not from e.
With backprop_loops = k (truncated backpropagation through depth) the first T - k loops run under torch.no_grad().

The forward returns per-loop readouts and gate logits, never T full-vocabulary logit tensors: the
objectives (titanloop.objectives) apply the shared LM head in chunks.

Module and parameter names follow the published Ouro checkpoints (q_proj, input_layernorm_2, ...), so
titanloop.interchange.ouro_hf maps them with a prefix only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from titanloop.config_errors import require
from titanloop.model.attention import (
    apply_rope,
    attention,
    causal_mask,
    document_mask,
    rows_are_documents,
    document_positions,
    rope_cos_sin,
)
from titanloop.model.config import LoopLMConfig
from titanloop.model.init import draw_seed
from titanloop.model.init import init_parameters


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in fp32 like the Hugging Face Ouro/Llama implementations, then cast back (no cast in fp32).
        dtype = x.dtype
        if dtype != torch.float32:
            x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * (x if dtype == torch.float32 else x.to(dtype))

    def reset_parameters(self):
        nn.init.ones_(self.weight)


class Attention(nn.Module):
    def __init__(self, cfg: LoopLMConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.backend = cfg.attention_backend
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, h, bias=False)

    def forward(self, x, cos, sin, mask=None, cache=None):
        b, s, _ = x.shape
        # -1 instead of the head count keeps this correct under tensor parallelism (local heads).
        q = self.q_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v)
        out = attention(q, k, v, mask, self.backend)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: LoopLMConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_hidden_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Sandwich RMSNorm (block_norm = "sandwich", Ouro): h += norm2(attn(norm1(h))); h += norm2'(mlp(norm1'(h))).
    Pre-norm (block_norm = "pre"): h += attn(norm1(h)); h += mlp(norm1'(h)), no norm on the branch outputs (the
    layer then has no input_layernorm_2 / post_attention_layernorm_2)."""

    def __init__(self, cfg: LoopLMConfig):
        super().__init__()
        sandwich = cfg.block_norm == "sandwich"
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)  # before attention
        if sandwich:
            self.input_layernorm_2 = RMSNorm(cfg.hidden_size, cfg.norm_eps)  # on the attention output
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)  # before the MLP
        if sandwich:
            self.post_attention_layernorm_2 = RMSNorm(cfg.hidden_size, cfg.norm_eps)  # on the MLP output
        self.sandwich = sandwich
        self.dropout = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else None  # training only

    def forward(self, h, cos, sin, mask=None, cache=None):
        a = self.self_attn(self.input_layernorm(h), cos, sin, mask, cache)
        if self.sandwich:
            a = self.input_layernorm_2(a)
        h = h + (a if self.dropout is None else self.dropout(a))
        m = self.mlp(self.post_attention_layernorm(h))
        if self.sandwich:
            m = self.post_attention_layernorm_2(m)
        return h + (m if self.dropout is None else self.dropout(m))


class DiagonalInjection(nn.Module):
    """Parcae's stable input injection: x <- A x + B e with A = exp(-softplus(dt) * exp(A_log)) per channel, so
    every entry of the diagonal A lies in (0, 1) and the map's spectral radius is < 1 by construction, whatever
    the parameters; B is a per-channel gain on the embedding e. At init A = 0.9 and B = 1."""

    A_DT_INIT = math.log(math.expm1(-math.log(0.9)))  # softplus(dt) = -ln 0.9 with A_log = 0: A = 0.9

    def __init__(self, dim: int):
        super().__init__()
        self.A_log = nn.Parameter(torch.zeros(dim))
        self.dt = nn.Parameter(torch.full((dim,), self.A_DT_INIT))
        self.B = nn.Parameter(torch.ones(dim))

    def decay(self) -> torch.Tensor:
        """The diagonal of A, in fp32: each entry in (0, 1)."""
        return torch.exp(-F.softplus(self.dt.float()) * torch.exp(self.A_log.float()))

    def forward(self, x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        return self.decay().to(x.dtype) * x + self.B.to(x.dtype) * e


@dataclass
class LoopLMOutput:
    """What one forward returns, per loop t = 1..T (index t-1)."""

    readouts: list[torch.Tensor]  # [B, S, H] each: what the shared LM head decodes at loop t
    states: list[torch.Tensor]  # [B, S, H] each: raw hidden state H_t after loop t (scale diagnostics)
    gate_logits: torch.Tensor  # [T, B, S]: exit-gate logits, λ_t = sigmoid(gate_logits[t-1])
    next_input: torch.Tensor | None = None  # x_T: what loop T+1 would receive (JSRR linearizes Φ here)
    last_input: torch.Tensor | None = None  # x_{T-1}: what loop T received (JSRR at T == max_loops, per-loop norms)
    logits: torch.Tensor | None = None  # only when asked: [B, S, V] (last loop) or [T, B, S, V] (all)
    loop_change: torch.Tensor | None = None  # only when asked: [B, S], LoopLM.loop_change (the fixed-point penalty)

    @property
    def n_loops(self) -> int:
        return len(self.readouts)


@dataclass
class LoopStep:
    """One loop t of a forward, as `LoopLM.loops` yields it (t = 1..T)."""

    t: int  # 1-based loop index
    loop_input: torch.Tensor  # [B, S, H] x_{t-1}: the input this loop received (JSRR linearizes Φ here)
    state: torch.Tensor  # [B, S, H] raw hidden state H_t after the looped block
    pre: torch.Tensor  # [B, S, H] H_t after the coda layers (if any): the readout before the final norm
    normed: torch.Tensor  # [B, S, H] final norm of `pre`
    exit_readout: torch.Tensor  # [B, S, H] what the LM head decodes when the model stops at loop t
    gate_logit: torch.Tensor  # [B, S] exit-gate logit z_t, λ_t = sigmoid(z_t)
    next_input: torch.Tensor  # [B, S, H] x_t: the input loop t+1 receives


class LoopLM(nn.Module):
    def __init__(self, cfg: LoopLMConfig):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        # drawn first (building the submodules below consumes torch's global RNG): the weights' seed, also used
        # by titanloop.model.init.materialize when the model is built on the meta device and sharded
        self.init_seed = draw_seed()
        h = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h)
        self.embed_dropout = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else None  # training only
        self.prelude = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_prelude_layers))
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_layers))  # the looped stack
        self.coda = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_coda_layers))
        self.norm = RMSNorm(h, cfg.norm_eps)
        self.early_exit_gate = nn.Linear(h, 1, bias=True)
        self.recurrence_gate = nn.Linear(2 * h, h, bias=True) if cfg.gated_recurrence else None
        self.injection = DiagonalInjection(h) if cfg.inject_embedding and cfg.injection == "diagonal" else None
        self.loop_norms = (
            nn.ModuleList(RMSNorm(h, cfg.norm_eps) for _ in range(cfg.max_loops)) if cfg.per_loop_norm else None
        )
        self.lm_head = nn.Linear(h, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # Set by the parallel plan for per-loop activation checkpointing: wraps loop_step calls.
        self.loop_wrapper: Callable | None = None
        # Set by titanloop.parallel.apply_compile when the layers compile with fullgraph=True: document masks
        # then use only kernels that trace (titanloop.model.attention.document_kernel).
        self.graph_safe_attention = False
        self.compiled_layers = False  # set by titanloop.parallel.compile.apply_compile
        self.init_weights(seed=self.init_seed)

    # ----- initialization ---------------------------------------------------------------------
    def init_rule(self, module: nn.Module, name: str) -> tuple[str, float]:
        """How parameter `name` (its path in the bare model) of `module` (its owner) is initialized:
        ("normal", std) or ("const", value). The one table for the full-model init and for the per-shard
        init of a meta-device build under FSDP/TP (titanloop.model.init)."""
        std = self.cfg.init_std
        if isinstance(module, RMSNorm):
            return ("const", 1.0)
        if module is self.early_exit_gate and name.endswith(".bias"):
            return ("const", 0.0)
        if module is self.recurrence_gate:  # zero W, bias -2: retain ~88% of the old state at init
            return ("const", self.cfg.gate_bias_init if name.endswith(".bias") else 0.0)
        if module is self.injection:  # A = 0.9, B = 1 at init
            return ("const", {"A_log": 0.0, "dt": DiagonalInjection.A_DT_INIT, "B": 1.0}[name.rsplit(".", 1)[1]])
        if module is self.embed_tokens and self.cfg.embed_init_std is not None:
            return ("normal", self.cfg.embed_init_std)
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            return ("normal", std / math.sqrt(2 * max(1, self.cfg.n_layers)))
        return ("normal", std)

    @torch.no_grad()
    def init_weights(self, buffer_device=None, seed: int | None = None):
        """Initialize every parameter from `seed` (default: drawn from torch's global RNG, so
        `torch.manual_seed(s); LoopLM(cfg)` is reproducible). Each parameter has its own generator, so the
        values do not depend on the order, the device placement of other parameters or the sharding
        (titanloop.model.init materializes only a rank's shards and gets the same full weights)."""
        init_parameters(self, seed)

    # ----- pieces the objectives and parallel plans use -----------------------------------------
    def rope(self, seq_len: int, device, dtype, positions: torch.Tensor | None = None, offset: int = 0):
        if positions is not None:
            return rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, dtype)
        # positions 0..S-1 (every training step): the tables of the last (S, device, dtype) are kept, not recomputed
        key = (seq_len, offset, str(device), dtype)
        cached = getattr(self, "_rope_tables", None)
        if cached is None or cached[0] != key or torch.compiler.is_compiling():
            positions = torch.arange(offset, offset + seq_len, device=device)
            cached = (key, rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, dtype))
            if not torch.compiler.is_compiling():
                self._rope_tables = cached
        return cached[1]

    def rope_and_mask(
        self,
        input_ids: torch.Tensor,
        *,
        doc_ids: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        kv_cache=None,
        position_offset: int = 0,
    ):
        """RoPE cos/sin tables and the attention mask for one forward over input_ids: None (plain causal), a
        DocumentMask (document boundaries, no dense mask) or a dense boolean mask (attention_backend 'sdpa',
        or decoding with a cache)."""
        s = input_ids.shape[1]
        dtype = self.embed_tokens.weight.dtype
        host_doc_ids = None
        if doc_ids is not None and doc_ids.device != input_ids.device:  # e.g. the trainer's batch, on the host
            host_doc_ids, doc_ids = doc_ids, doc_ids.to(input_ids.device, non_blocking=True)
        if doc_ids is not None and positions is None and kv_cache is None and self.cfg.rope_per_document:
            positions = document_positions(doc_ids)
        cos, sin = self.rope(s, input_ids.device, dtype, positions, position_offset)
        mask = None
        backend = self.cfg.attention_backend
        if doc_ids is not None and kv_cache is None:  # no dense [S, S] mask unless the backend is 'sdpa'
            # rows that are whole documents run plain causal attention (SDPA's causal kernel, no per-document work)
            if not rows_are_documents(doc_ids, host_doc_ids, backend, self.compiled_layers):
                mask = document_mask(
                    doc_ids, backend, dtype, graph_safe=self.graph_safe_attention, host_doc_ids=host_doc_ids
                )
        elif doc_ids is not None:
            mask = causal_mask(s, s, input_ids.device, doc_ids)
        elif kv_cache is not None and position_offset > 0 and s > 1:
            mask = causal_mask(s, s + position_offset, input_ids.device)
        return cos, sin, mask

    def loop_step(self, x: torch.Tensor, t: int, cos, sin, mask=None, kv_cache=None) -> torch.Tensor:
        """One application of the looped block at loop index t (0-based): x -> raw state H_{t+1}."""
        h_in = self.loop_norms[t](x) if self.loop_norms is not None else x
        h = h_in
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, mask, kv_cache.get("loop", t, i) if kv_cache is not None else None)
        if self.recurrence_gate is not None:
            g = torch.sigmoid(self.recurrence_gate(torch.cat([h, x], dim=-1)))
            h = g * h + (1 - g) * x
        return h

    def next_loop_input(self, h: torch.Tensor, normed: torch.Tensor | None = None) -> torch.Tensor:
        """x_t, the next loop's input, from loop t's raw state H_t: H_t itself, or its inter-loop norm (which is
        `normed`, the readout's norm, when there are no coda layers in between)."""
        if not self.cfg.inter_loop_norm:
            return h
        return normed if normed is not None and not self.coda else self.norm(h)

    def recurrent_map(self, x: torch.Tensor, t: int, cos, sin, mask=None) -> torch.Tensor:
        """Φ: the map from loop t's input to loop t+1's input (loop_step plus the inter-loop norm). With
        inject_embedding the next input also adds the embedding, a constant in x: Φ here leaves it out, which
        changes no Jacobian (JSRR and the spectral diagnostics use only those); the diagonal injection's A scales
        it."""
        nxt = self.next_loop_input(self.loop_step(x, t, cos, sin, mask))
        return nxt if self.injection is None else self.injection.decay().to(nxt.dtype) * nxt

    def loop_change(self, out: "LoopLMOutput", n_loops: int, cos, sin, mask=None) -> torch.Tensor:
        """[B, S]: the relative change one more loop makes to what the loops pass on, per token:
        ||u_{T+1} - u_T|| / ||u_T|| with u_t = next_loop_input(H_t) (the normed state under inter-loop norm), u_T
        from the forward's last state and u_{T+1} from loop T+1 run on its input x_T (out.next_input). The
        injection adds the same embedding to both, so this is the change of the next loop's input as well. Zero
        at a fixed point of the map; the fixed-point penalty (objective.fixed_point_weight) asks for it."""
        require(
            self.loop_norms is None,
            "model.per_loop_norm",
            True,
            "false for the fixed-point penalty (one map shared by every loop, defined past the last one)",
        )
        u = self.next_loop_input(out.states[-1])
        nxt = self.next_loop_input(self.loop_step(out.next_input, n_loops, cos, sin, mask))
        dtype = torch.promote_types(u.dtype, torch.float32)  # at least fp32
        return (nxt - u).to(dtype).norm(dim=-1) / u.to(dtype).norm(dim=-1).clamp_min(1e-6)

    def inject(self, x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """The next loop's input from x and the embedding e: x + e, or A x + B e (injection='diagonal')."""
        return x + e if self.injection is None else self.injection(x, e)

    def initial_state(self, e: torch.Tensor, seed: int | None = None, position_offset: int = 0) -> torch.Tensor:
        """Huginn's random initial state: a normal of std init_state_std (default the embedding's init std),
        truncated at 3 std, shaped like e. seed (training: one per micro-batch) draws the [B, S, H] state from a
        generator seeded with it; None (evaluation, generation) gives every position p (from `position_offset`) a
        fixed state, a function of (p, channel) only: the same for every sequence of a batch and whether decoded
        with a KV cache or not, so evaluation is deterministic."""
        c = self.cfg
        std = c.init_state_std or c.embed_init_std or c.init_std
        from torch._subclasses.fake_tensor import is_fake

        if is_fake(e):  # the memory plan's fake tensors: the shape is all that counts
            return torch.randn_like(e) * std
        b, s, h = e.shape
        if seed is not None:
            g = torch.Generator(device=e.device).manual_seed(int(seed))
            noise = torch.empty(e.shape, device=e.device, dtype=torch.float32)
            torch.nn.init.trunc_normal_(noise, 0.0, std, -3 * std, 3 * std, generator=g)
            return noise.to(e.dtype)
        # a counter-based draw (a generator's stream is not prefix-consistent): u uniform from a hash of (p, channel),
        # then the inverse normal CDF restricted to [-3, 3]
        pos = torch.arange(position_offset, position_offset + s, device=e.device, dtype=torch.float64)
        ch = torch.arange(h, device=e.device, dtype=torch.float64)
        u = torch.frac(torch.sin(pos[:, None] * 12.9898 + ch[None, :] * 78.233 + 0.5).abs() * 43758.5453)
        lo = 0.5 * math.erfc(3 / math.sqrt(2))  # Phi(-3)
        z = math.sqrt(2) * torch.erfinv(2 * (lo + u * (1 - 2 * lo)) - 1)
        return (z * std).to(e.dtype).expand(b, s, h)

    def head_input(self, state: torch.Tensor, t: int, cos, sin, mask=None, kv_cache=None) -> torch.Tensor:
        """Coda layers (if any) on a loop's raw state; the readout/gate/next-loop input start from this."""
        for i, layer in enumerate(self.coda):
            state = layer(state, cos, sin, mask, kv_cache.get("coda", t, i) if kv_cache is not None else None)
        return state

    def readout(self, pre: torch.Tensor, normed: torch.Tensor, t: int, n_loops: int) -> torch.Tensor:
        mode = self.cfg.readout
        if mode == "norm" or (mode == "final_only_norm" and t == n_loops - 1):
            return normed
        return pre

    def embed(self, input_ids: torch.Tensor, cos, sin, mask=None, kv_cache=None) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.embed_dropout is not None:
            x = self.embed_dropout(x)
        for i, layer in enumerate(self.prelude):
            x = layer(x, cos, sin, mask, kv_cache.get("prelude", 0, i) if kv_cache is not None else None)
        return x

    # ----- forward ----------------------------------------------------------------------------
    def loops(
        self,
        input_ids: torch.Tensor,
        n_loops: int | None = None,
        *,
        doc_ids: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        kv_cache=None,
        position_offset: int = 0,
        backprop_loops: int = 0,
        init_seed: int | None = None,
        rope_mask: tuple | None = None,
    ) -> Iterator[LoopStep]:
        """The loop over t = 1..T, yielding a LoopStep after each loop; the caller may stop early (break).
        `forward`, evaluation (titanloop.eval.trace) and early exit all run the model through this loop.

        n_loops: T (default cfg.n_loops); any T >= 1 works, beyond the trained depth too.
        doc_ids: [B, S] document index per token; restricts attention to the token's own document. It may stay in
            host memory while input_ids is on the GPU: the document boundaries are then read on the host (no sync).
        kv_cache / position_offset: incremental decoding (see titanloop.eval.generate).
        backprop_loops: k > 0 runs the first T - k loops under torch.no_grad() (truncated backpropagation through
            depth): their LoopSteps hold no graph, and the first loop with a graph starts from a detached input.
        init_seed: the seed of the random initial state (init_state='random'; default 0).
        rope_mask: (cos, sin, mask) of rope_and_mask for these arguments when the caller has them already.
        """
        t_total = self.cfg.n_loops if n_loops is None else int(n_loops)
        require(t_total >= 1, "n_loops", n_loops, "an integer >= 1")
        if self.loop_norms is not None:
            require(
                t_total <= len(self.loop_norms),
                "n_loops",
                t_total,
                f"<= max_loops={len(self.loop_norms)} when per_loop_norm is on",
            )
        cos, sin, mask = rope_mask or self.rope_and_mask(
            input_ids, doc_ids=doc_ids, positions=positions, kv_cache=kv_cache, position_offset=position_offset
        )
        x = self.embed(input_ids, cos, sin, mask, kv_cache)
        injected = x if self.cfg.inject_embedding else None
        if self.cfg.init_state == "random":  # Huginn: noise, with the embedding injected as into every later loop
            x = self.inject(self.initial_state(x, init_seed, position_offset), injected)
        step = self.loop_step if self.loop_wrapper is None else self.loop_wrapper(self.loop_step)
        no_grad_loops = t_total - backprop_loops if 0 < backprop_loops < t_total else 0
        for t in range(t_total):
            if t < no_grad_loops:  # truncated: no graph, no activation checkpointing to wrap
                with torch.no_grad():
                    s = self._loop(self.loop_step, x, t, injected, cos, sin, mask, kv_cache)
            else:
                s = self._loop(step, x, t, injected, cos, sin, mask, kv_cache)
            yield s
            x = s.next_input

    def _loop(self, step, x, t, injected, cos, sin, mask, kv_cache) -> LoopStep:
        h = step(x, t, cos, sin, mask, kv_cache)
        pre = self.head_input(h, t, cos, sin, mask, kv_cache)
        normed = self.norm(pre)
        nxt = self.next_loop_input(h, normed)
        if injected is not None:
            nxt = self.inject(nxt, injected)
        return LoopStep(
            t=t + 1,
            loop_input=x,
            state=h,
            pre=pre,
            normed=normed,
            exit_readout=self.readout(pre, normed, t, t + 1),
            gate_logit=self.early_exit_gate(normed).squeeze(-1),
            next_input=nxt,
        )

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
        exit_readouts: bool = False,
        backprop_loops: int = 0,
        init_seed: int | None = None,
        loop_change: bool = False,
    ) -> LoopLMOutput:
        """input_ids [B, S] -> LoopLMOutput with per-loop readouts, raw states and exit-gate logits (arguments as
        in `loops`). return_logits: None, 'last' ([B,S,V] of the last loop) or 'all' ([T,B,S,V]; small models).
        exit_readouts: readouts[t] is what the model decodes when it stops at loop t (LoopStep.exit_readout, as
        titanloop.eval scores it) instead of loop t's readout within a T-loop forward (they differ only for
        readout='final_only_norm'); validation during training uses it.
        backprop_loops: k > 0 truncates backpropagation through depth (see `loops`); the output then holds the last
        min(k, T) loops only, those with a graph (readouts[0] is loop T - k + 1's).
        loop_change: also run loop T + 1 and return out.loop_change (LoopLM.loop_change), inside the forward so that
        the parallel wrappers (FSDP2 and its memory tracker, DeepSpeed) see it as part of the model's step."""
        t_total = self.cfg.n_loops if n_loops is None else int(n_loops)
        kept_from = t_total - backprop_loops if 0 < backprop_loops < t_total else 0
        readouts, states, gates, x, last_input = [], [], [], None, None
        rope_mask = None  # loop T + 1 needs the loops' RoPE tables and mask: made once, for both
        if loop_change:
            rope_mask = self.rope_and_mask(
                input_ids, doc_ids=doc_ids, positions=positions, kv_cache=kv_cache, position_offset=position_offset
            )
        for s in self.loops(
            input_ids,
            t_total,
            doc_ids=doc_ids,
            positions=positions,
            kv_cache=kv_cache,
            position_offset=position_offset,
            backprop_loops=backprop_loops,
            init_seed=init_seed,
            rope_mask=rope_mask,
        ):
            x, last_input = s.next_input, s.loop_input
            if s.t <= kept_from:
                continue
            readouts.append(s.exit_readout if exit_readouts else self.readout(s.pre, s.normed, s.t - 1, t_total))
            states.append(s.state)
            gates.append(s.gate_logit)
        out = LoopLMOutput(
            readouts=readouts, states=states, gate_logits=torch.stack(gates), next_input=x, last_input=last_input
        )
        if loop_change:
            out.loop_change = self.loop_change(out, t_total, *rope_mask)
        if return_logits == "last":
            out.logits = self.lm_head(readouts[-1])
        elif return_logits == "all":
            out.logits = torch.stack([self.lm_head(r) for r in readouts])
        elif return_logits is not None:
            require(False, "return_logits", return_logits, "None, 'last' or 'all'")
        return out

    def num_params(self) -> int:
        return sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())


def build_looplm(cfg: LoopLMConfig, device=None) -> LoopLM:
    with torch.device(device or "cpu"):
        return LoopLM(cfg)
