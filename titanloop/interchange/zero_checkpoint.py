"""Read a DeepSpeed-native ZeRO checkpoint (`engine.save_checkpoint`, e.g. from a DeepSpeed-based codebase
such as Ouroboros) as LoopLM weights; `python -m titanloop.train.zero_import` writes them as a titanloop
checkpoint (model weights only, in the DCP layout of titanloop.checkpoint):

    python -m titanloop.train.zero_import DS_DIR --config train_configs/<x>.toml --out RUN_DIR [--tag T]

DS_DIR is the folder given to `save_checkpoint` (with `latest`) or one tag folder inside it. DeepSpeed's own
consolidation (deepspeed.utils.zero_to_fp32, ZeRO stage 1-3, any world size) assembles the fp32 master
weights; its pickled files are read with `torch.load(weights_only=True)` and an allow-list of the DeepSpeed
types they hold, so nothing in them can execute code. Tensor names may be titanloop's, titanloop's under
the DeepSpeed engine's root module (`model.<name>`), or Ouro Hugging Face names (`model.layers.0...`,
`lm_head.weight`). The model shape comes from the training config. The result is
`RUN_DIR/checkpoints/step-N` (N = the DeepSpeed global step) with the usual manifest: load it with
`titanloop.checkpoint.loading.load_model`, export it with `export_ouro_hf`, or start a stage from it
(`[stage] init_from = "RUN_DIR/checkpoints"`, `keep_optimizer = false`, optionally `upcycle = "stack"`).

titanloop's own DeepSpeed engine never writes this format: its checkpoints are titanloop checkpoints
already (docs/engines.md).
"""

from __future__ import annotations

from pathlib import Path

import torch

from titanloop.config_errors import ConfigError
from titanloop.model import LoopLM


class _SafeTorch:
    """The `torch` that deepspeed.utils.zero_to_fp32 sees: torch.load is always weights_only=True."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def load(f, *args, **kwargs):
        kwargs.pop("weights_only", None)  # DeepSpeed passes weights_only=False
        return torch.load(f, *args, weights_only=True, **kwargs)


def _allowed_globals() -> list:
    """The DeepSpeed types a ZeRO checkpoint pickles besides tensors and containers (data-only classes)."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    return [ZeroStageEnum, LossScaler]


def read_zero_fp32_state(ds_dir, tag: str | None = None) -> dict[str, torch.Tensor]:
    """The consolidated fp32 weights {name: tensor} of a DeepSpeed ZeRO checkpoint (pickle-free read)."""
    from unittest import mock

    path = Path(ds_dir)
    if tag is None and not (path / "latest").is_file() and any(path.glob("*_model_states.pt")):
        path, tag = path.parent, path.name  # a tag folder was given
    if tag is None and not (path / "latest").is_file():
        raise ConfigError(
            f"deepspeed checkpoint {str(ds_dir)!r} has no `latest` file and no *_model_states.pt: "
            "pass the folder given to save_checkpoint, or one of its tag folders"
        )
    from deepspeed.utils import zero_to_fp32

    try:
        with (
            mock.patch.object(zero_to_fp32, "torch", _SafeTorch()),
            torch.serialization.safe_globals(_allowed_globals()),
        ):
            state = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(path), tag=tag)
    except FileNotFoundError as e:
        raise ConfigError(f"deepspeed checkpoint {str(ds_dir)!r} is incomplete: {e}") from None
    except Exception as e:  # noqa: BLE001 - the unpickler's refusal of a type is a ValueError/UnpicklingError
        if "Unsupported global" in str(e) or "weights_only" in str(e).lower():
            raise ConfigError(
                f"deepspeed checkpoint {str(ds_dir)!r} holds a Python type outside the allow-list "
                "of titanloop's safe reader; convert it with DeepSpeed's zero_to_fp32.py in a "
                "trusted environment and import the resulting weights"
            ) from None
        raise
    return {k: v.float() for k, v in state.items()}


def global_step(ds_dir, tag: str | None = None) -> int:
    """The step the DeepSpeed checkpoint was saved at (from its tag, e.g. global_step1000; else 0)."""
    path = Path(ds_dir)
    name = tag or ((path / "latest").read_text().strip() if (path / "latest").is_file() else path.name)
    digits = "".join(c for c in name if c.isdigit())
    return int(digits) if digits else 0


def to_looplm_state(state: dict[str, torch.Tensor], model: LoopLM) -> dict[str, torch.Tensor]:
    """Rename titanloop / engine-wrapped / Ouro HF names to the LoopLM's and check every tensor's shape."""
    live = model.state_dict()
    out = {}
    for name, value in state.items():
        key = name if name in live else (name[len("model.") :] if name.startswith("model.") else name)
        if key not in live:
            raise ConfigError(
                f"deepspeed checkpoint tensor {name!r} is not a parameter of the configured LoopLM: "
                "pass the training config of the model that was saved (--config)"
            )
        if tuple(value.shape) != tuple(live[key].shape):
            raise ConfigError(
                f"deepspeed checkpoint tensor {name!r} has shape {tuple(value.shape)}, the configured "
                f"LoopLM needs {tuple(live[key].shape)}: pass the matching --config"
            )
        out[key] = value
    if model.cfg.tie_embeddings and "lm_head.weight" not in out and "embed_tokens.weight" in out:
        out["lm_head.weight"] = out["embed_tokens.weight"]
    missing = sorted(set(live) - set(out))
    if missing:
        raise ConfigError(
            f"deepspeed checkpoint lacks {missing[0]!r} ({len(missing)} missing) of the configured "
            "LoopLM: pass the training config of the model that was saved (--config)"
        )
    return out
