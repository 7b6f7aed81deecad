"""A RetrofitLM from a titanloop training checkpoint of a retrofit run (DCP step dir or checkpoint folder).

The manifest's stored training config gives the [retrofit] section and the loop settings of [model]; the trained
depth gives T; the base model's shape comes from its config.json at retrofit.hf_path (the weights, trained and
frozen, all come from the checkpoint). Checkpoints written before the loop settings moved to [model] and
[loop_sampler] hold them in their [retrofit] section, and load as they are.
"""

from __future__ import annotations

from pathlib import Path

from titanloop.config_errors import ConfigError
from titanloop.checkpoint.loading import load_dcp_model_weights, published_step_dir, trained_depth
from titanloop.retrofit.config import LOOP_KEYS, RetrofitConfig
from titanloop.retrofit.hf_import import read_hf_config
from titanloop.retrofit.model import RetrofitLM


def load_retrofit_checkpoint(path) -> RetrofitLM:
    step_dir, manifest = published_step_dir(Path(path))
    section = (manifest.get("config") or {}).get("retrofit") or {}
    if not section.get("hf_path"):
        raise ConfigError(
            f"checkpoint {str(step_dir)!r} is not from a retrofit run (its config has no "
            "retrofit.hf_path): load it with titanloop.checkpoint.loading.load_model"
        )
    config = manifest["config"]
    model_section = config.get("model") or {}
    loops = {k: model_section[k] for k in LOOP_KEYS if k in model_section}
    depth = trained_depth(manifest)
    if depth is not None:
        loops["n_loops"] = depth["n_loops"]
    cfg = RetrofitConfig.from_dict({**section, **loops})
    _, shape = read_hf_config(cfg.hf_path)
    model = RetrofitLM(shape, cfg)
    load_dcp_model_weights(model, step_dir, ("lm_head.weight",) if shape.tie_embeddings else ())
    model.freeze_base()
    return model.eval()
