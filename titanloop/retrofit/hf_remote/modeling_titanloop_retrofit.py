"""Hugging Face modeling code of a titanloop Ouroboros-retrofit model (model_type "titanloop_retrofit").

A pretrained Qwen2/Llama decoder cut into Prelude / one recurrent layer (looped n_loops times) / Coda, with
frozen low-rank bases A_k, B_k on the recurrent layer's seven projections modulated per step by a diagonal
(CompactController hypernetwork or a static per-step table), a per-step RMSNorm on each new state and a gated
recurrence x = g*h + (1-g)*x. Written by titanloop (titanloop/retrofit/hf_remote; the training-side model is
titanloop.retrofit.model.RetrofitLM, and tests/test_retrofit.py checks both give the same logits).

Self-contained (torch + transformers). Forward only: full sequences, no KV cache, no padding.
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from .configuration_titanloop_retrofit import TitanloopRetrofitConfig

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def plain(lin, target, x):
    return lin(x)


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.head_dim = c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=c.qkv_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.qkv_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.qkv_bias)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=c.o_bias)

    def forward(self, x, cos, sin, proj):
        b, n, _ = x.shape
        q = proj(self.q_proj, "q_proj", x).view(b, n, -1, self.head_dim).transpose(1, 2)
        k = proj(self.k_proj, "k_proj", x).view(b, n, -1, self.head_dim).transpose(1, 2)
        v = proj(self.v_proj, "v_proj", x).view(b, n, -1, self.head_dim).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        return proj(self.o_proj, "o_proj", out.transpose(1, 2).reshape(b, n, -1))


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias)

    def forward(self, x, proj):
        return proj(
            self.down_proj, "down_proj", F.silu(proj(self.gate_proj, "gate_proj", x)) * proj(self.up_proj, "up_proj", x)
        )


class Layer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, h, cos, sin, proj=plain):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, proj)
        return h + self.mlp(self.post_attention_layernorm(h), proj)


class LoRABases(nn.Module):
    def __init__(self, c):
        super().__init__()
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        h, f = c.hidden_size, c.intermediate_size
        dims = {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, f),
            "up_proj": (h, f),
            "down_proj": (f, h),
        }
        for k, (d_in, d_out) in dims.items():
            self.register_parameter(f"{k}_A", nn.Parameter(torch.zeros(c.lora_rank, d_in)))
            self.register_parameter(f"{k}_B", nn.Parameter(torch.zeros(d_out, c.lora_rank)))

    def modulated(self, deltas, scale):
        def proj(lin, target, x):
            a = F.linear(x, getattr(self, f"{target}_A"))
            return lin(x) + scale * F.linear(a * deltas[target], getattr(self, f"{target}_B"))

        return proj


def mean_pool(x, causal):
    if causal:
        pos = torch.arange(1, x.shape[1] + 1, device=x.device)
        return (x.float().cumsum(1) / pos[None, :, None]).to(x.dtype)
    return x.mean(1, keepdim=True)


class Controller(nn.Module):
    def __init__(self, c):
        super().__init__()
        s, self.rank, self.causal = c.style_dim, c.lora_rank, c.pooling == "causal"
        self.proj = nn.Linear(c.hidden_size, 2 * s)
        self.step_embed = nn.Embedding(c.max_loops, s)
        self.style_in = nn.Linear(3 * s, 2 * s)
        self.style_out = nn.Linear(2 * s, s)
        self.heads = nn.Linear(s, len(TARGETS) * c.lora_rank)

    def forward(self, x, t):
        z = F.silu(self.proj(mean_pool(x, self.causal)))
        e = self.step_embed.weight[t].expand(*z.shape[:-1], -1)
        u = self.style_out(F.silu(self.style_in(torch.cat([z, e], dim=-1))))
        return dict(zip(TARGETS, self.heads(u).split(self.rank, dim=-1)))


class Static(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.deltas = nn.Parameter(torch.zeros(c.max_loops, len(TARGETS), c.lora_rank))

    def forward(self, x, t):
        return {k: self.deltas[t, i].view(1, 1, -1) for i, k in enumerate(TARGETS)}


class RetrofitModel(nn.Module):
    def __init__(self, c):
        super().__init__()
        d = c.hidden_size
        self.config = c
        self.embed_tokens = nn.Embedding(c.vocab_size, d)
        self.prelude = nn.ModuleList(Layer(c) for _ in range(c.n_prelude))
        self.layers = nn.ModuleList([Layer(c)])
        self.coda = nn.ModuleList(Layer(c) for _ in range(c.n_coda))
        self.norm = RMSNorm(d, c.rms_norm_eps)
        self.lora = LoRABases(c) if c.modulation != "none" else None
        self.modulation = {"controller": Controller, "static": Static}.get(c.modulation, lambda c: None)(c)
        self.recurrence_gate = nn.Linear(2 * d, d) if c.gated_recurrence else None
        self.step_norms = nn.ModuleList(RMSNorm(d, c.rms_norm_eps) for _ in range(c.max_loops)) if c.step_norm else None

    def forward(self, input_ids, n_loops):
        c = self.config
        pos = torch.arange(input_ids.shape[1], device=input_ids.device, dtype=torch.float32)
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, device=input_ids.device).float() / c.head_dim))
        emb = torch.cat([pos[:, None] * inv] * 2, dim=-1)
        dtype = self.embed_tokens.weight.dtype
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
        x = self.embed_tokens(input_ids)
        for layer in self.prelude:
            x = layer(x, cos, sin)
        for t in range(n_loops):
            proj = plain
            if self.modulation is not None:
                proj = self.lora.modulated(self.modulation(x, t), c.lora_alpha / c.lora_rank)
            h = self.layers[0](x, cos, sin, proj)
            if self.step_norms is not None:
                h = self.step_norms[t](h)
            if self.recurrence_gate is not None:
                g = torch.sigmoid(self.recurrence_gate(torch.cat([h, x], dim=-1)))
                h = g * h + (1 - g) * x
            x = h
        for layer in self.coda:
            x = layer(x, cos, sin)
        return self.norm(x)


class TitanloopRetrofitForCausalLM(PreTrainedModel):
    config_class = TitanloopRetrofitConfig
    base_model_prefix = "model"
    _tied_weights_keys = ["lm_head.weight"]

    def __init__(self, config):
        super().__init__(config)
        self.model = RetrofitModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def _init_weights(self, module):  # every weight comes from the checkpoint; keep shapes sane otherwise
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def forward(self, input_ids=None, attention_mask=None, labels=None, n_loops=None, **kwargs):
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("titanloop_retrofit runs unpadded sequences only: pass attention_mask=None or all ones")
        n_loops = n_loops or self.config.n_loops
        if (self.model.step_norms is not None or self.model.modulation is not None) and n_loops > self.config.max_loops:
            raise ValueError(f"n_loops={n_loops} exceeds max_loops={self.config.max_loops} (per-step parameters)")
        logits = self.lm_head(self.model(input_ids, n_loops))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutput(loss=loss, logits=logits)
