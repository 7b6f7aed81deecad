"""Export a LoopLM to, and import it from, a Hugging Face directory in the layout of the published Ouro
checkpoints (ByteDance/Ouro-1.4B, Ouro-2.6B; RECIPE §1).

Layout written and read:

    config.json                      model_type "ouro", architectures ["OuroForCausalLM"], total_ut_steps, ...
    model.safetensors                all tensors, or, above `max_shard_bytes`:
    model-0000k-of-0000n.safetensors + model.safetensors.index.json  {"metadata": {"total_size"}, "weight_map"}

Tensor names are titanloop's parameter names with a `model.` prefix (`lm_head.weight` stays as is), e.g.
`model.layers.3.self_attn.q_proj.weight`, `model.layers.3.input_layernorm_2.weight`,
`model.early_exit_gate.bias`. A tied LM head is not stored (`tie_word_embeddings: true`), as in Hugging Face.

model_type "ouro" is written only for models the Ouro Hugging Face code (modeling_ouro.py) computes exactly:
per loop the shared stack, then the final norm, whose output is decoded, gated and fed to the next loop.
A variant it cannot represent (`ouro_incompatibilities`: readout raw / final_only_norm, inter_loop_norm
false, prelude/coda layers, gated recurrence, per-loop norms, pre-norm layers) is refused with a one-line reason,
or, with `allow_variant=True` (CLI `--allow-variant`), written under model_type "titanloop_looplm", which the Ouro code
does not claim and only titanloop loads. The variant settings (and max_loops, ...) go into a `"titanloop"`
sub-dict of config.json and extra tensors (`model.prelude.*`, `model.coda.*`, `model.recurrence_gate.*`,
`model.loop_norms.*`), so export -> import is exact. A plain Ouro directory (no sub-dict) imports with the
defaults, which reproduce Ouro. docs/interchange.md lists the variants and the paper each follows.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from titanloop.config_errors import ConfigError
from titanloop.model import LoopLM, LoopLMConfig

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5_000_000_000  # Hugging Face's default max_shard_size ("5GB")

# Ouro config.json key <- LoopLMConfig field
_OURO_KEYS = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "intermediate_size": "ffn_hidden_size",
    "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads",
    "num_key_value_heads": "kv_heads",
    "total_ut_steps": "n_loops",
    "max_position_embeddings": "max_seq_len",
    "rope_theta": "rope_theta",
    "rms_norm_eps": "norm_eps",
    "tie_word_embeddings": "tie_embeddings",
}
_OPTIONAL_OURO_KEYS = {"initializer_range": "init_std"}
# LoopLMConfig fields with no Ouro key: stored under config.json["titanloop"].
_TITANLOOP_FIELDS = (
    "max_loops",
    "readout",
    "inter_loop_norm",
    "inject_embedding",
    "injection",
    "init_state",
    "init_state_std",
    "n_prelude_layers",
    "n_coda_layers",
    "gated_recurrence",
    "gate_bias_init",
    "per_loop_norm",
    "block_norm",
    "attention_backend",
    "rope_per_document",
)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def hf_name(name: str) -> str:
    """titanloop parameter name -> Ouro tensor name."""
    return name if name.startswith("lm_head.") else "model." + name


def titanloop_name(name: str) -> str:
    return name[len("model.") :] if name.startswith("model.") else name


def _dtype_name(dtype: torch.dtype) -> str:
    for k, v in _DTYPES.items():
        if v == dtype:
            return k
    raise ConfigError(f"dtype={dtype} is invalid: expected one of {sorted(_DTYPES)}")


VARIANT_MODEL_TYPE = "titanloop_looplm"  # a LoopLM variant the Ouro HF code does not compute
MODEL_TYPES = ("ouro", VARIANT_MODEL_TYPE)


def ouro_incompatibilities(cfg: LoopLMConfig) -> list[str]:
    """Why the Ouro HF code would compute something else than a LoopLM with `cfg` ([] = it computes the same)."""
    why = []
    if cfg.readout != "norm":
        why.append(f"readout={cfg.readout!r} (the Ouro code decodes norm(h_t) at every loop)")
    if not cfg.inter_loop_norm:
        why.append("inter_loop_norm=false (the Ouro code feeds norm(h_t) into the next loop)")
    if cfg.inject_embedding:
        why.append("inject_embedding=true (the Ouro code does not add the embedding to later loops' inputs)")
    if cfg.injection != "add":
        why.append(f"injection={cfg.injection!r} (the Ouro code has no diagonal injection A x + B e)")
    if cfg.init_state != "embedding":
        why.append(f"init_state={cfg.init_state!r} (the Ouro code starts the first loop from the embedding)")
    if cfg.n_prelude_layers or cfg.n_coda_layers:
        why.append(
            f"n_prelude_layers={cfg.n_prelude_layers}, n_coda_layers={cfg.n_coda_layers} (the Ouro code has "
            "only the looped stack)"
        )
    if cfg.gated_recurrence:
        why.append("gated_recurrence=true (the Ouro code has no recurrence gate)")
    if cfg.per_loop_norm:
        why.append("per_loop_norm=true (the Ouro code has no per-loop norm)")
    if cfg.block_norm != "sandwich":
        why.append(f"block_norm={cfg.block_norm!r} (the Ouro code's layers norm each sublayer's output too)")
    return why


# ----- config.json ----------------------------------------------------------------------------------
def ouro_config_dict(cfg: LoopLMConfig, dtype: torch.dtype = torch.float32, early_exit_threshold: float = 1.0) -> dict:
    """The config.json for `cfg` (plus the "titanloop" sub-dict for the variants): model_type "ouro" when the
    Ouro HF code computes this model, else VARIANT_MODEL_TYPE."""
    if ouro_incompatibilities(cfg):
        d = {"architectures": ["TitanloopLoopLMForCausalLM"], "model_type": VARIANT_MODEL_TYPE}
    else:
        d = {"architectures": ["OuroForCausalLM"], "model_type": "ouro"}
    for key, field in _OURO_KEYS.items():
        d[key] = getattr(cfg, field)
    d.update(
        {
            "head_dim": cfg.head_dim,
            "hidden_act": "silu",
            "initializer_range": cfg.init_std,
            "early_exit_threshold": early_exit_threshold,
            "attention_dropout": 0.0,
            "rope_scaling": None,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": cfg.n_layers,
            "layer_types": ["full_attention"] * cfg.n_layers,
            "use_cache": True,
            "torch_dtype": _dtype_name(dtype),
            "titanloop": {f: getattr(cfg, f) for f in _TITANLOOP_FIELDS},
        }
    )
    return d


def looplm_config_from_ouro(d: dict, source: str = "config.json") -> LoopLMConfig:
    """LoopLMConfig from an Ouro config.json dict; one-line ConfigError for anything titanloop cannot load."""
    if d.get("model_type") not in MODEL_TYPES:
        raise ConfigError(
            f"{source}: model_type={d.get('model_type')!r} is invalid: expected 'ouro' "
            f"(an Ouro / OuroForCausalLM checkpoint directory) or {VARIANT_MODEL_TYPE!r}"
        )
    missing = [k for k in _OURO_KEYS if k not in d and k not in ("num_key_value_heads", "tie_word_embeddings")]
    if missing:
        raise ConfigError(f"{source}: missing key(s) {missing}: an Ouro config.json needs {sorted(_OURO_KEYS)}")
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{source}: hidden_act={act!r} is invalid: expected 'silu' (SwiGLU)")
    if d.get("rope_scaling"):
        raise ConfigError(
            f"{source}: rope_scaling={d['rope_scaling']!r} is invalid: expected null "
            "(titanloop implements plain RoPE; change rope_theta instead)"
        )
    if d.get("use_sliding_window"):
        raise ConfigError(f"{source}: use_sliding_window=true is invalid: expected false (full attention)")
    fields = {f: d[k] for k, f in {**_OURO_KEYS, **_OPTIONAL_OURO_KEYS}.items() if k in d}
    kv = fields.pop("kv_heads", None)
    fields["n_kv_heads"] = None if kv is None or kv == fields["n_heads"] else kv
    extra = d.get("titanloop") or {}
    unknown = sorted(set(extra) - set(_TITANLOOP_FIELDS))
    if unknown:
        raise ConfigError(f"{source}: titanloop key(s) {unknown} are unknown: allowed are {list(_TITANLOOP_FIELDS)}")
    fields.update(extra)
    fields.setdefault("max_loops", max(LoopLMConfig.max_loops, fields["n_loops"]))
    cfg = LoopLMConfig(**fields)
    why = ouro_incompatibilities(cfg)
    if bool(why) != (d["model_type"] == VARIANT_MODEL_TYPE):
        expected = VARIANT_MODEL_TYPE if why else "ouro"
        raise ConfigError(
            f"{source}: model_type={d['model_type']!r} is invalid for this model: expected {expected!r}"
            + (f" because of {why[0]}" if why else " (no titanloop-only variant is set)")
            + f'; set "model_type": {expected!r} in config.json if the weights are right'
        )
    head_dim = d.get("head_dim")
    if head_dim is not None and head_dim != cfg.head_dim:
        raise ConfigError(
            f"{source}: head_dim={head_dim} is invalid: expected hidden_size/num_attention_heads={cfg.head_dim}"
        )
    return cfg


# ----- tensors ----------------------------------------------------------------------------------------
def expected_tensors(cfg: LoopLMConfig) -> dict[str, tuple[int, ...]]:
    """Ouro tensor name -> shape for a model with `cfg` (a tied LM head is not stored)."""
    with torch.device("meta"):
        model = LoopLM(cfg)
    return {hf_name(n): tuple(t.shape) for n, t in _stored_state(model).items()}


def _stored_state(model: LoopLM) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    if model.cfg.tie_embeddings:
        state.pop("lm_head.weight")
    return state


def _plan_shards(names_sizes: list[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    shards, current, size = [], [], 0
    for name, nbytes in names_sizes:
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    if current:
        shards.append(current)
    return shards


def export_ouro_hf(
    model: LoopLM,
    out_dir,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    early_exit_threshold: float = 1.0,
    allow_variant: bool = False,
) -> Path:
    """Write `model` as an Ouro Hugging Face directory; returns the directory.

    A model the Ouro HF code cannot compute (ouro_incompatibilities) is refused with a one-line ConfigError,
    unless allow_variant=True: then it is written under model_type VARIANT_MODEL_TYPE (titanloop loads it).

    dtype: cast floating tensors (e.g. torch.bfloat16 as the published checkpoints); default: keep the model's.
    max_shard_bytes: above this total the weights are split into shards with a model.safetensors.index.json.
    """
    if max_shard_bytes < 1:
        raise ConfigError(f"max_shard_bytes={max_shard_bytes} is invalid: expected a positive byte count")
    why = ouro_incompatibilities(model.cfg)
    if why and not allow_variant:
        raise ConfigError(
            f"cannot export as Ouro (model_type 'ouro'): {why[0]}"
            + (f" and {len(why) - 1} more" if len(why) > 1 else "")
            + f"; pass allow_variant=True (CLI --allow-variant) to write model_type "
            f"{VARIANT_MODEL_TYPE!r}, which only titanloop loads"
        )
    state = _stored_state(model)
    dtype = dtype or model.embed_tokens.weight.dtype
    tensors = {hf_name(n): t.detach().to("cpu", dtype).contiguous() for n, t in state.items()}
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"out_dir={str(out)!r} is invalid: it is a file, expected a directory (new or existing)")
    out.parent.mkdir(parents=True, exist_ok=True)
    # Write into a sibling staging directory and move the files in only when all are written, so a failed
    # export never leaves a half-written checkpoint or destroys a previous one in `out`.
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.export-", dir=out.parent))
    try:
        _write_checkpoint(staging, tensors, ouro_config_dict(model.cfg, dtype, early_exit_threshold), max_shard_bytes)
        out.mkdir(exist_ok=True)
        for stale in [out / WEIGHTS_FILE, out / INDEX_FILE, *out.glob("model-*-of-*.safetensors")]:
            stale.unlink(missing_ok=True)  # a previous export with a different sharding must not linger
        for f in sorted(staging.iterdir()):
            os.replace(f, out / f.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def _write_checkpoint(out: Path, tensors: dict, config: dict, max_shard_bytes: int) -> None:
    metadata = {"format": "pt"}
    shards = _plan_shards([(n, t.numel() * t.element_size()) for n, t in tensors.items()], max_shard_bytes)
    if len(shards) == 1:
        save_file(tensors, str(out / WEIGHTS_FILE), metadata=metadata)
    else:
        weight_map = {}
        for i, names in enumerate(shards, 1):
            fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file({n: tensors[n] for n in names}, str(out / fname), metadata=metadata)
            weight_map.update({n: fname for n in names})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        (out / INDEX_FILE).write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n"
        )
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


def _read_json(path: Path):
    """A JSON file's value; one-line ConfigError for a file that is not UTF-8 JSON (binary, cut, garbled)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a JSON text file (not UTF-8): re-export the directory") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}): re-export the directory") from None


@contextlib.contextmanager
def _open_weights(f: Path):
    """safe_open(f) on the CPU; one-line ConfigError for a file safetensors cannot read (truncated, garbled)."""
    try:
        handle = safe_open(str(f), framework="pt", device="cpu")
    except (SafetensorError, OSError) as e:
        raise ConfigError(
            f"{f}: not a readable safetensors file ({str(e).strip() or type(e).__name__}): it is truncated or "
            "corrupt; re-export the directory"
        ) from None
    with handle as sf:
        yield sf


def read_ouro_config(path) -> LoopLMConfig:
    path = Path(path)
    cfg_file = path / CONFIG_FILE
    if not cfg_file.is_file():
        raise ConfigError(f"path={str(path)!r} is invalid: expected a Hugging Face directory with {CONFIG_FILE}")
    d = _read_json(cfg_file)
    if not isinstance(d, dict):
        raise ConfigError(f"{cfg_file}: expected a JSON object, got {type(d).__name__}: re-export the directory")
    return looplm_config_from_ouro(d, str(cfg_file))


def weight_files(path) -> dict[str, Path]:
    """Ouro tensor name -> the safetensors file holding it (single file or sharded with an index)."""
    path = Path(path)
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = _read_json(index)
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict):
            raise ConfigError(f"{index}: missing 'weight_map': expected a Hugging Face safetensors index")
        files = {n: path / f for n, f in weight_map.items()}
        for f in sorted(set(files.values())):
            if not f.is_file():
                raise ConfigError(f"{index}: shard {f.name!r} is missing from {path}")
        return files
    single = path / WEIGHTS_FILE
    if not single.is_file():
        raise ConfigError(f"path={str(path)!r} has no {WEIGHTS_FILE} or {INDEX_FILE}: expected safetensors weights")
    with _open_weights(single) as f:
        return {n: single for n in f.keys()}


def check_tensors(cfg: LoopLMConfig, path) -> dict[str, Path]:
    """Validate names and shapes of the stored tensors (reads headers only); returns name -> file."""
    files = weight_files(path)
    expected = expected_tensors(cfg)
    for name, shape in expected.items():
        if name not in files:
            raise ConfigError(f"tensor {name!r} is missing from {path}: expected shape {list(shape)}")
    unexpected = sorted(set(files) - set(expected))
    if unexpected:
        raise ConfigError(
            f"tensor {unexpected[0]!r} in {path} is unexpected for this config.json "
            f"({len(unexpected)} unexpected in all); check the titanloop variant keys"
        )
    by_file: dict[Path, list[str]] = {}
    for name, f in files.items():
        by_file.setdefault(f, []).append(name)
    for f, names in by_file.items():
        with _open_weights(f) as sf:
            stored = set(sf.keys())
            for name in names:
                if name not in stored:
                    raise ConfigError(
                        f"tensor {name!r} is missing from {f.name} (listed in {INDEX_FILE}): "
                        f"expected shape {list(expected[name])}"
                    )
                shape = tuple(sf.get_slice(name).get_shape())
                if shape != expected[name]:
                    raise ConfigError(
                        f"tensor {name!r} in {f.name} has shape {list(shape)}: expected {list(expected[name])}"
                    )
    return files


def import_ouro_hf(path, device="cpu", dtype: torch.dtype | None = None) -> LoopLM:
    """Load an Ouro Hugging Face directory (published or exported by titanloop) as a LoopLM.

    dtype: None keeps the stored dtype (bitwise round trip); otherwise tensors are cast to it.
    device: where the model lives. Each stored tensor is read, moved to `device` in `dtype` and dropped from
    CPU memory before the next one is read, so the whole model is never held on the CPU a second time (a
    2.6B checkpoint loads onto a GPU with one tensor at a time in CPU memory). The model is built on the meta
    device and the loaded tensors are assigned, so no random init runs.
    """
    cfg = read_ouro_config(path)
    files = check_tensors(cfg, path)
    device = torch.device(device)
    state = {}
    for f in sorted(set(files.values())):
        with _open_weights(f) as sf:
            for name in sf.keys():
                # copy=True: safetensors hands out views at arbitrary byte offsets of the file buffer, and CPU
                # matmul kernels round differently on unaligned memory; fresh storage keeps logits identical.
                t = sf.get_tensor(name)
                state[titanloop_name(name)] = t.to(device=device, dtype=dtype or t.dtype, copy=True)
                del t
    with torch.device("meta"):
        model = LoopLM(cfg)
    model.load_state_dict(state, strict=not cfg.tie_embeddings, assign=True)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model


def summarize(path) -> dict:
    """Config summary and parameter count of an Ouro directory, from config.json and tensor headers only."""
    cfg = read_ouro_config(path)
    files = check_tensors(cfg, path)
    n_stored = 0
    dtypes = set()
    for f in sorted(set(files.values())):
        with _open_weights(f) as sf:
            for name in sf.keys():
                sl = sf.get_slice(name)
                numel = 1
                for s in sl.get_shape():
                    numel *= s
                n_stored += numel
                dtypes.add(sl.get_dtype())
    return {
        "path": os.fspath(path),
        "config": cfg.to_dict(),
        "stored_params": n_stored,
        "param_count": cfg.param_count(),
        "dtypes": sorted(dtypes),
        "n_files": len(set(files.values())),
    }
