"""Import a local Hugging Face dense checkpoint (Qwen2 / Llama layout, safetensors) into a RetrofitLM.

The config is read with transformers' own config classes (AutoConfig -> Qwen2Config / LlamaConfig, local
files only); weights come from `model.safetensors` or a sharded `model.safetensors.index.json`, read one
tensor at a time. Kept layers are copied; the removed layers only contribute the SVD-initialized LoRA bases
(ouroboros §3.2):
    Δ_k = mean_{l removed} (W_{l,k} - W_{R,k}),  Δ_k = U S V^T,  A_k = V_r^T,  B_k = U_r S_r  (both frozen)
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

from titanloop.config_errors import ConfigError, require
from titanloop.retrofit.config import TARGETS, RetrofitConfig
from titanloop.retrofit.model import DenseShape, RetrofitLM
from titanloop.model.config import LoopLMConfig

SUPPORTED = ("qwen2", "llama")
_SUBMODULE = {k: ("self_attn" if k in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp") for k in TARGETS}


def read_hf_config(path: str | Path):
    """(transformers config, DenseShape) of the checkpoint at `path`; unsupported variants are refused."""
    p = Path(path)
    if not (p / "config.json").is_file():
        raise ConfigError(
            f"retrofit.hf_path={str(path)!r} has no config.json: pass a local Hugging Face "
            "model directory (save_pretrained output)"
        )
    return _read_hf_config(str(p.resolve()), (p / "config.json").stat().st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _read_hf_config(path: str, mtime_ns: int):
    p = Path(path)
    model_type = json.loads((p / "config.json").read_text()).get("model_type")
    require(model_type in SUPPORTED, "model_type", model_type, f"one of {SUPPORTED} in {p / 'config.json'}")
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(str(p), local_files_only=True)
    require(c.hidden_act == "silu", "hidden_act", c.hidden_act, "'silu' (SwiGLU MLP)")
    scaling = getattr(c, "rope_scaling", None)
    require(
        not scaling or scaling.get("rope_type", scaling.get("type")) == "default",
        "rope_scaling",
        scaling,
        "None (RoPE scaling variants are not implemented by the retrofit model)",
    )
    require(
        not getattr(c, "use_sliding_window", False),
        "use_sliding_window",
        True,
        "false (sliding-window attention is not implemented by the retrofit model)",
    )
    llama = model_type == "llama"
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    shape = DenseShape(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        n_heads=c.num_attention_heads,
        n_kv_heads=c.num_key_value_heads or c.num_attention_heads,
        head_dim=head_dim,
        ffn_hidden_size=c.intermediate_size,
        n_layers=c.num_hidden_layers,
        norm_eps=c.rms_norm_eps,
        rope_theta=float(c.rope_theta),
        qkv_bias=bool(c.attention_bias) if llama else True,
        o_bias=bool(c.attention_bias) if llama else False,
        mlp_bias=bool(getattr(c, "mlp_bias", False)),
        tie_embeddings=bool(c.tie_word_embeddings),
        max_seq_len=c.max_position_embeddings,
    )
    return c, shape


class SafetensorsReader:
    """Tensors by name from a single or sharded safetensors checkpoint, opened lazily."""

    def __init__(self, path: str | Path):
        from safetensors import safe_open

        p = Path(path)
        index = p / "model.safetensors.index.json"
        if index.is_file():
            files = {k: p / v for k, v in json.loads(index.read_text())["weight_map"].items()}
        elif (p / "model.safetensors").is_file():
            with safe_open(p / "model.safetensors", framework="pt") as f:
                files = {k: p / "model.safetensors" for k in f.keys()}
        else:
            raise ConfigError(
                f"retrofit.hf_path={str(path)!r} has no model.safetensors(.index.json): save the "
                "model with save_pretrained(safe_serialization=True)"
            )
        self.files, self._open, self._safe_open = files, {}, safe_open

    def has(self, name: str) -> bool:
        return name in self.files

    def get(self, name: str) -> torch.Tensor:
        if name not in self.files:
            raise ConfigError(f"checkpoint tensor {name!r} is missing: is this a complete Qwen2/Llama checkpoint?")
        f = self.files[name]
        if f not in self._open:
            self._open[f] = self._safe_open(f, framework="pt")
        return self._open[f].get_tensor(name)


def svd_bases(residual: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated SVD of a [d_out, d_in] residual: A = V_r^T [r, d_in], B = U_r S_r [d_out, r] (fp32)."""
    u, s, vh = torch.linalg.svd(residual.double(), full_matrices=False)
    return vh[:rank].float().contiguous(), (u[:, :rank] * s[:rank]).float().contiguous()


def _layer_weight(reader: SafetensorsReader, layer: int, target: str) -> torch.Tensor:
    return reader.get(f"model.layers.{layer}.{_SUBMODULE[target]}.{target}.weight").double()


@torch.no_grad()
def lora_bases_from_checkpoint(reader: SafetensorsReader, cfg: RetrofitConfig, n_layers: int) -> dict:
    """{target: (A, B)} from the removed layers' mean residual against layer R."""
    removed = cfg.removed_layers(n_layers)
    require(
        len(removed) >= 1,
        "retrofit",
        f"P={cfg.n_prelude}, R={cfg.recurrent_layer}, C={cfg.n_coda}",
        f"a split that removes at least one of the L={n_layers} layers (LoRA bases are built from them), "
        "or modulation='none'",
    )
    out = {}
    for k in TARGETS:
        w_r = _layer_weight(reader, cfg.recurrent_layer, k)
        mean = sum(_layer_weight(reader, i, k) for i in removed) / len(removed)
        out[k] = svd_bases(mean - w_r, cfg.lora_rank)
    return out


@torch.no_grad()
def load_retrofit(cfg: RetrofitConfig, hf_path: str | None = None) -> RetrofitLM:
    """The RetrofitLM of `cfg` with the dense checkpoint's weights (fp32) and SVD bases; base frozen."""
    path = hf_path or cfg.hf_path
    require(bool(path), "retrofit.hf_path", path, "a local Hugging Face model directory")
    _, shape = read_hf_config(path)
    model = RetrofitLM(shape, cfg)
    reader = SafetensorsReader(path)
    state = {
        "embed_tokens.weight": reader.get("model.embed_tokens.weight"),
        "norm.weight": reader.get("model.norm.weight"),
    }
    if not shape.tie_embeddings:
        state["lm_head.weight"] = reader.get("lm_head.weight")
    stacks = [
        ("prelude", range(cfg.n_prelude)),
        ("layers", [cfg.recurrent_layer]),
        ("coda", range(shape.n_layers - cfg.n_coda, shape.n_layers)),
    ]
    for stack, indices in stacks:
        for j, i in enumerate(indices):
            for name in getattr(model, stack)[j].state_dict():
                state[f"{stack}.{j}.{name}"] = reader.get(f"model.layers.{i}.{name}")
    if model.lora is not None:
        for k, (a, b) in lora_bases_from_checkpoint(reader, cfg, shape.n_layers).items():
            state[f"lora.{k}_A"], state[f"lora.{k}_B"] = a, b
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    trainable = {n for m in model.trainable_modules() for n, _ in getattr(model, m).named_parameters(prefix=m)}
    left = sorted(set(missing) - trainable - ({"lm_head.weight"} if shape.tie_embeddings else set()))
    require(
        not left and not unexpected,
        "checkpoint",
        path,
        f"all base weights to load (missing {left}, unexpected {unexpected})",
    )
    model.freeze_base()
    return model


def looplm_view(cfg: RetrofitConfig):
    """A LoopLMConfig with the retrofit model's shape (P prelude layers, 1 looped layer, C coda layers), so the
    training config's layout checks, data vocabulary and FLOP accounting apply to a retrofit run unchanged."""
    _, s = read_hf_config(cfg.hf_path)
    return LoopLMConfig(
        vocab_size=s.vocab_size,
        hidden_size=s.hidden_size,
        n_heads=s.n_heads,
        n_kv_heads=s.n_kv_heads,
        ffn_hidden_size=s.ffn_hidden_size,
        n_layers=1,
        n_loops=cfg.n_loops,
        max_loops=cfg.max_loops,
        max_seq_len=s.max_seq_len,
        rope_theta=s.rope_theta,
        norm_eps=s.norm_eps,
        n_prelude_layers=cfg.n_prelude,
        n_coda_layers=cfg.n_coda,
        gated_recurrence=cfg.gated_recurrence,
        per_loop_norm=cfg.step_norm,
        tie_embeddings=s.tie_embeddings,
        inter_loop_norm=False,
        readout="final_only_norm",
    )
