"""Export a RetrofitLM as its own Hugging Face model type ("titanloop_retrofit", never "ouro").

The directory holds config.json (model_type titanloop_retrofit, auto_map to the two remote-code files),
model.safetensors (the RetrofitLM's parameters under `model.`, the LM head as `lm_head.weight` unless tied)
and the modeling/configuration files from titanloop/retrofit/hf_remote, so that

    AutoModelForCausalLM.from_pretrained(out_dir, trust_remote_code=True)

runs the same forward as titanloop (tests/test_retrofit.py checks the logits). `load_exported` reads the
directory back into a titanloop RetrofitLM.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from titanloop.config_errors import ConfigError
from titanloop.retrofit.config import RetrofitConfig
from titanloop.retrofit.model import DenseShape, RetrofitLM
from titanloop.retrofit.checkpoint import load_retrofit_checkpoint

MODEL_TYPE = "titanloop_retrofit"
REMOTE_DIR = Path(__file__).parent / "hf_remote"
REMOTE_FILES = ("configuration_titanloop_retrofit.py", "modeling_titanloop_retrofit.py")


def hf_config_dict(model: RetrofitLM) -> dict:
    s, r = model.shape, model.rcfg
    return {
        "model_type": MODEL_TYPE,
        "architectures": ["TitanloopRetrofitForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_titanloop_retrofit.TitanloopRetrofitConfig",
            "AutoModelForCausalLM": "modeling_titanloop_retrofit.TitanloopRetrofitForCausalLM",
        },
        "vocab_size": s.vocab_size,
        "hidden_size": s.hidden_size,
        "num_attention_heads": s.n_heads,
        "num_key_value_heads": s.n_kv_heads,
        "head_dim": s.head_dim,
        "intermediate_size": s.ffn_hidden_size,
        "rms_norm_eps": s.norm_eps,
        "rope_theta": s.rope_theta,
        "max_position_embeddings": s.max_seq_len,
        "qkv_bias": s.qkv_bias,
        "o_bias": s.o_bias,
        "mlp_bias": s.mlp_bias,
        "tie_word_embeddings": s.tie_embeddings,
        "n_prelude": r.n_prelude,
        "n_coda": r.n_coda,
        "n_loops": r.n_loops,
        "max_loops": r.max_loops,
        "modulation": r.modulation,
        "lora_rank": r.lora_rank,
        "lora_alpha": r.lora_alpha,
        "style_dim": r.style_dim,
        "pooling": r.pooling,
        "gated_recurrence": r.gated_recurrence,
        "step_norm": r.step_norm,
        "source_layers": {"n_layers": s.n_layers, "recurrent_layer": r.recurrent_layer},
        "torch_dtype": "float32",
    }


def export_hf(model: RetrofitLM, out_dir) -> Path:
    """Write `model` to out_dir (created) as a titanloop_retrofit Hugging Face directory."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight":
            if not model.shape.tie_embeddings:
                tensors[name] = t
        else:
            tensors[f"model.{name}"] = t
    save_file(
        {k: v.detach().float().contiguous().cpu() for k, v in tensors.items()},
        out / "model.safetensors",
        metadata={"format": "pt"},
    )
    (out / "config.json").write_text(json.dumps(hf_config_dict(model), indent=2) + "\n")
    for f in REMOTE_FILES:
        shutil.copy(REMOTE_DIR / f, out / f)
    return out


def load_exported(path) -> RetrofitLM:
    """A titanloop RetrofitLM from a titanloop_retrofit directory written by export_hf."""
    from safetensors.torch import load_file

    p = Path(path)
    c = json.loads((p / "config.json").read_text()) if (p / "config.json").is_file() else {}
    if c.get("model_type") != MODEL_TYPE:
        raise ConfigError(
            f"path={str(p)!r} is not a {MODEL_TYPE} export (config.json model_type="
            f"{c.get('model_type')!r}): expected a directory written by titanloop.retrofit.export"
        )
    src = c["source_layers"]
    shape = DenseShape(
        vocab_size=c["vocab_size"],
        hidden_size=c["hidden_size"],
        n_heads=c["num_attention_heads"],
        n_kv_heads=c["num_key_value_heads"],
        head_dim=c["head_dim"],
        ffn_hidden_size=c["intermediate_size"],
        n_layers=src["n_layers"],
        norm_eps=c["rms_norm_eps"],
        rope_theta=c["rope_theta"],
        qkv_bias=c["qkv_bias"],
        o_bias=c["o_bias"],
        mlp_bias=c["mlp_bias"],
        tie_embeddings=c["tie_word_embeddings"],
        max_seq_len=c["max_position_embeddings"],
    )
    fields = (
        "n_prelude",
        "n_coda",
        "n_loops",
        "max_loops",
        "modulation",
        "lora_rank",
        "lora_alpha",
        "style_dim",
        "pooling",
        "gated_recurrence",
        "step_norm",
    )
    cfg = RetrofitConfig(recurrent_layer=src["recurrent_layer"], **{k: c[k] for k in fields})
    model = RetrofitLM(shape, cfg)
    stored = load_file(p / "model.safetensors")
    state = {(k[len("model.") :] if k.startswith("model.") else k): v for k, v in stored.items()}
    if shape.tie_embeddings:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    model.load_state_dict(state, strict=True)
    model.freeze_base()
    return model


def export_from_checkpoint(checkpoint, out_dir) -> Path:
    """Export the model of a titanloop training checkpoint (DCP step dir or checkpoint folder) of a retrofit run."""
    return export_hf(load_retrofit_checkpoint(checkpoint), out_dir)
