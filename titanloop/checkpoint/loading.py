"""`load_model(path)`: the one place evaluation and generation load a checkpoint from disk.

Accepted formats:
  1. an Ouro Hugging Face directory (config.json with model_type "ouro" + model.safetensors or a sharded
     index), as written by `titanloop.interchange.ouro_hf.export_ouro_hf` or published by ByteDance;
  2. a titanloop.checkpoint DCP checkpoint: a published `step-N` directory (`.metadata` + titanloop.json),
     or the checkpoint folder holding `latest` (the newest step is used). The model shape comes from the
     training config stored in titanloop.json (`config.model`: a preset plus overrides); only the model
     tensors are read (not the optimizer).
Anything else is refused with a one-line ConfigError naming the path and the accepted formats.

Integrity: a DCP checkpoint's files are checked against its manifest (size and crc32 of every file) before a
tensor is read, as a resume checks them, and a model with a NaN or infinite weight is refused (either format).

Where the model goes: `device` and `dtype` (`resolve_device` / `resolve_dtype`: "auto" is CUDA in bfloat16
when torch.cuda.is_available(), else the CPU in float32). The model is built on the meta device and allocated
once, uninitialized, on the target device in the target dtype; the stored tensors are then read into it one at
a time (DCP through the restricted reader, safetensors tensor by tensor). So a checkpoint never has a second
full copy in CPU memory: besides the model itself (on the device), at most one stored tensor is held on the
CPU at a time, and no random initialization runs.
"""

from __future__ import annotations

from pathlib import Path

import torch

from titanloop.config_errors import ConfigError
from titanloop.model import LoopLM, LoopLMConfig, preset
from titanloop.interchange.ouro_hf import import_ouro_hf, read_ouro_config
from titanloop.checkpoint.safe_reader import load_dcp, read_dcp_metadata
from titanloop.checkpoint import layout
from titanloop.checkpoint.errors import CheckpointError
from titanloop.data.tokenizer import tokenizer_fingerprint

ACCEPTED = (
    "an Ouro Hugging Face directory (config.json + *.safetensors, from titanloop.interchange export_ouro_hf)",
    "a titanloop DCP checkpoint (step-N dir or the folder with `latest`)",
)


def checkpoint_format(path) -> str:
    """'ouro_hf' | 'dcp'; ConfigError for anything else."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"checkpoint path={str(p)!r} does not exist: expected {ACCEPTED[0]} or {ACCEPTED[1]}")
    if p.is_dir() and (p / "config.json").is_file():
        return "ouro_hf"
    if p.is_dir() and ((p / ".metadata").is_file() or (p / "latest").is_file()):
        return "dcp"
    raise ConfigError(f"checkpoint path={str(p)!r} is not a LoopLM checkpoint: expected {ACCEPTED[0]} or {ACCEPTED[1]}")


def trained_depth(manifest: dict) -> dict | None:
    """The loop count a checkpoint was trained at: titanloop.json's "trained_depth" (kind, n_loops, min, max),
    or for a checkpoint written before it was recorded, the stored config's loop sampler; None if neither."""
    if isinstance(manifest.get("trained_depth"), dict):
        return manifest["trained_depth"]
    sampler = (manifest.get("config") or {}).get("loop_sampler")
    if isinstance(sampler, dict) and isinstance(sampler.get("n_loops"), int):
        kind = sampler.get("kind", "fixed")
        lo, hi = (
            (sampler["n_loops"],) * 2
            if kind == "fixed"
            else (sampler.get("min_sampled", 1), sampler.get("max_sampled", sampler["n_loops"]))
        )
        return {"kind": kind, "n_loops": sampler["n_loops"], "min": lo, "max": hi}
    return None


def _model_config_from_manifest(manifest: dict, ckpt: Path) -> LoopLMConfig:
    """The [model] section the trainer stored in titanloop.json ({"preset": name, **overrides} or all fields), at
    the depth it was trained at (the loop sampler's T: `trained_depth`), which becomes the model's default depth
    for evaluation, sweeps, exits and export."""
    section = (manifest.get("config") or {}).get("model")
    if not isinstance(section, dict):
        raise ConfigError(
            f"checkpoint {str(ckpt)!r} has no model config (titanloop.json config.model): it is not "
            "a titanloop training checkpoint; save with Checkpointer(config=train_config.to_dict())"
        )
    section = dict(section)
    depth = trained_depth(manifest)
    if depth is not None:
        section.pop("n_loops", None)
    name = section.pop("preset", None)
    cfg = preset(name, **section) if name is not None else LoopLMConfig.from_dict(section)
    if depth is None:
        return cfg
    return cfg.replace(n_loops=depth["n_loops"], max_loops=max(cfg.max_loops, depth["n_loops"]))


def published_step_dir(path: Path) -> tuple[Path, dict]:
    """(step dir, manifest) of a titanloop.checkpoint DCP checkpoint: a step dir, or a folder whose `latest`
    names one. ConfigError for anything else."""
    if not (path / ".metadata").is_file():
        step = layout.latest_step(path)
        if step is None:
            raise ConfigError(
                f"checkpoint path={str(path)!r} has no published checkpoint: expected a step-N "
                "directory or a checkpoint folder with `latest`"
            )
        path = path / layout.step_dir_name(step)
    if not (path / layout.MANIFEST).is_file():
        raise ConfigError(
            f"checkpoint path={str(path)!r} is a DCP checkpoint without {layout.MANIFEST} (e.g. "
            "torchtitan's CheckpointManager format, which does not record the model config): "
            "expected a titanloop.checkpoint checkpoint, or export the model to an Ouro HF directory"
        )
    return path, layout.read_manifest(path)


def checkpoint_tokenizer(path) -> str | None:
    """The tokenizer.json a checkpoint's text goes through, if it names one: `tokenizer.json` beside an Ouro HF
    directory's weights (the export copies it there), or the `[data] tokenizer` (else `[validation.data]`'s) of the
    training config a DCP checkpoint stores, when that file still exists; None otherwise."""
    p = Path(path)
    if checkpoint_format(p) == "ouro_hf":
        return str(p / "tokenizer.json") if (p / "tokenizer.json").is_file() else None
    config = published_step_dir(p)[1].get("config") or {}
    for section in (config.get("data") or {}, ((config.get("validation") or {}).get("data") or {})):
        name = section.get("tokenizer") if isinstance(section, dict) else None
        if isinstance(name, str) and Path(name).is_file():
            return name
    return None


def check_tokenizer(path, tokenizer: str, what: str, fix: str) -> str | None:
    """Refuse (one-line ConfigError) a tokenizer whose fingerprint is not the one of the tokenizer the checkpoint at
    `path` names (`checkpoint_tokenizer`): its text would be other token ids than the model learned. `tokenizer`
    is a tokenizer.json path or an "sha1:..." fingerprint (e.g. a shard manifest's); `what` names it in the message
    (e.g. "--tokenizer='tok.json'"), `fix` says what to do instead. Returns the checkpoint's tokenizer path, or
    None when it names none (nothing to compare with)."""
    own = checkpoint_tokenizer(path)
    if own is None:
        return None
    theirs = tokenizer if str(tokenizer).startswith("sha1:") else tokenizer_fingerprint(tokenizer)
    expected = tokenizer_fingerprint(own)
    if theirs != expected:
        raise ConfigError(
            f"{what} is not the checkpoint's tokenizer: fingerprint {theirs}, the checkpoint {str(path)!r} was "
            f"trained with {own} ({expected}); {fix}"
        )
    return own


DEVICE_VALUES = "auto, cpu, cuda or cuda:N"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def resolve_device(spec="auto", name: str = "device") -> torch.device:
    """ "auto" -> "cuda" when torch.cuda.is_available(), else "cpu"; "cpu"; "cuda" / "cuda:N" (when there is such
    a GPU). A torch.device is taken as it is (e.g. "meta" from Python). One-line ConfigError naming `name`."""
    if isinstance(spec, torch.device):
        return spec
    text = str(spec).strip().lower()
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if text == "cpu":
        return torch.device("cpu")
    if text == "cuda" or (text.startswith("cuda:") and text[5:].isdigit()):
        if not torch.cuda.is_available():
            raise ConfigError(
                f"{name}={spec!r} is invalid here: torch.cuda.is_available() is False on this machine; "
                "expected auto or cpu"
            )
        device = torch.device(text)
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(
                f"{name}={spec!r} is invalid: this machine has {torch.cuda.device_count()} CUDA device(s); "
                f"expected cuda:0..cuda:{torch.cuda.device_count() - 1}"
            )
        return device
    raise ConfigError(f"{name}={spec!r} is invalid: expected {DEVICE_VALUES}")


def resolve_dtype(spec, device: torch.device, name: str = "dtype") -> torch.dtype | None:
    """ "auto" -> bfloat16 on CUDA, float32 elsewhere; a name in DTYPES (or fp32/bf16/fp16); a torch.dtype as it
    is; None stays None (the loader keeps its default: see `load_model`). One-line ConfigError naming `name`."""
    if spec is None or isinstance(spec, torch.dtype):
        return spec
    text = str(spec).strip().lower()
    if text == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    text = DTYPE_ALIASES.get(text, text)
    if text not in DTYPES:
        raise ConfigError(f"{name}={spec!r} is invalid: expected auto, float32, bfloat16 or float16")
    return DTYPES[text]


def empty_looplm(cfg: LoopLMConfig, device, dtype: torch.dtype | None = None) -> LoopLM:
    """A LoopLM whose parameters are allocated, uninitialized, directly on `device` in `dtype` (default: the
    default float dtype): built on the meta device, cast there (free), then `to_empty`. No random init runs
    and nothing passes through the CPU. Tied embeddings stay tied (to_empty would untie them)."""
    with torch.device("meta"):
        model = LoopLM(cfg)
    if dtype is not None:
        model.to(dtype)
    model.to_empty(device=device)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model


def verify_checkpoint_files(path: Path) -> None:
    """Every file the manifest of step dir `path` lists, with its size and crc32, as a resume checks them: a flipped
    or cut byte is a one-line CheckpointError here instead of a wrong weight. In one process it reads every file;
    when torch.distributed is initialized (a new stage loading the previous one on every rank, as DCP's collective
    load does) each rank checks its share of the bytes and every rank raises the first error any rank found."""
    manifest = layout.read_manifest(path)
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        layout.verify_files(path, manifest)
        return
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    error = None
    try:
        layout.verify_files(path, manifest, layout.crc_share(manifest, rank, world))
    except CheckpointError as e:
        error = str(e)
    errors: list = [None] * world
    torch.distributed.all_gather_object(errors, error)
    error = next((e for e in errors if e), None)
    if error:
        raise CheckpointError(error)


def load_dcp_model_weights(model: torch.nn.Module, path: Path, tied: tuple[str, ...] = ()) -> None:
    """Read the `model/...` tensors of the DCP step dir `path` into `model`'s own tensors, in place, on whatever
    device and in whatever dtype they are (model tensors only, through the restricted reader, which reads one
    stored tensor at a time into CPU memory and copies it into its target); `tied` names parameters that may be
    absent because they share another one's storage."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    verify_checkpoint_files(path)
    stored = read_dcp_metadata(path / ".metadata").state_dict_metadata
    live = model.state_dict()  # detached views of the parameters: loading writes into the model itself
    targets = {f"model/{k}": v for k, v in live.items() if f"model/{k}" in stored}
    missing = sorted(k for k in live if f"model/{k}" not in stored and k not in tied)
    if missing:
        raise ConfigError(
            f"checkpoint {str(path)!r} lacks model tensor {missing[0]!r} ({len(missing)} missing): "
            f"it does not hold a {type(model).__name__} of the stored config"
        )
    not_tensors = sorted(k for k in targets if not isinstance(stored[k], TensorStorageMetadata))
    if not_tensors:
        raise ConfigError(
            f"checkpoint {str(path)!r} stores {not_tensors[0]!r} as a non-tensor entry, not as a "
            "tensor: it is not a titanloop training checkpoint (refusing to load it)"
        )
    load_dcp(targets, path, no_dist=not torch.distributed.is_initialized())  # one process: no group needed


def _load_dcp(path: Path, device, dtype) -> LoopLM:
    """Model weights of a titanloop.checkpoint DCP checkpoint (a step dir, or a folder whose `latest` names one)."""
    path, manifest = published_step_dir(path)
    model = empty_looplm(_model_config_from_manifest(manifest, path), device, dtype)
    load_dcp_model_weights(model, path, ("lm_head.weight",) if model.cfg.tie_embeddings else ())
    return model


def checkpoint_model_config(path) -> LoopLMConfig:
    """The model config of a checkpoint (formats in the module docstring), from its config files alone: no tensor
    is read, so a command can check its arguments against the model before loading it."""
    if checkpoint_format(path) == "ouro_hf":
        return read_ouro_config(path)
    step, manifest = published_step_dir(Path(path))
    return _model_config_from_manifest(manifest, step)


def refuse_nonfinite(model: torch.nn.Module, path) -> None:
    """One-line CheckpointError naming the first parameter or buffer of `model` with a NaN or an infinity (tensors
    on the meta device hold no values and pass)."""
    for name, t in model.state_dict().items():
        if torch.is_floating_point(t) and not t.is_meta and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise CheckpointError(
                f"checkpoint {str(path)!r} has {bad} non-finite value(s) in tensor {name!r}: it is corrupt or "
                "from a diverged run; use an earlier checkpoint"
            )


def load_model(path, device="cpu", dtype: torch.dtype | str | None = None) -> LoopLM:
    """Load a LoopLM from `path` (formats in the module docstring), in eval mode, straight onto `device` in
    `dtype` (see `resolve_device` / `resolve_dtype`; "auto" for either picks CUDA + bfloat16 when there is a
    GPU). dtype None: a DCP checkpoint loads in float32, an Ouro HF directory in the dtype it stores."""
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    fmt = checkpoint_format(path)
    if fmt == "ouro_hf":
        model = import_ouro_hf(path, device=device, dtype=dtype)
    else:
        model = _load_dcp(Path(path), device, dtype)
    if not isinstance(model, LoopLM):
        raise ConfigError(f"checkpoint path={str(path)!r} did not load as a LoopLM (got {type(model).__name__})")
    refuse_nonfinite(model, path)
    return model.eval()
