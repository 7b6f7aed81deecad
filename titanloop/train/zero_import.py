"""`python -m titanloop.train.zero_import DS_DIR --config train_configs/<x>.toml --out RUN_DIR [--tag T]`: a
DeepSpeed-native ZeRO checkpoint as a titanloop checkpoint (model weights only; the reading and the name mapping are
titanloop.interchange.zero_checkpoint's). The model shape comes from the training config; the result is
`RUN_DIR/checkpoints/step-N` (N = the DeepSpeed global step) with the usual manifest: load it with
`titanloop.checkpoint.loading.load_model`, export it with `export_ouro_hf`, or start a stage from it
(`[stage] init_from = "RUN_DIR/checkpoints"`, `keep_optimizer = false`, optionally `upcycle = "stack"`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from titanloop.checkpoint import CheckpointConfig, Checkpointer, layout
from titanloop.config_errors import ConfigError, cli_errors
from titanloop.interchange.zero_checkpoint import global_step, read_zero_fp32_state, to_looplm_state
from titanloop.model import LoopLM
from titanloop.train.config import load_config


def import_zero_checkpoint(
    ds_dir, config_path, out_run_dir, tag: str | None = None, overrides: list[str] | None = None
) -> Path:
    """Write the DeepSpeed checkpoint's weights as a titanloop checkpoint in out_run_dir; returns the step dir."""
    cfg = load_config(config_path, overrides, world_size=1)
    model = LoopLM(cfg.looplm)
    with torch.no_grad():
        model.load_state_dict(to_looplm_state(read_zero_fp32_state(ds_dir, tag), model), strict=True)
    step = global_step(ds_dir, tag)
    ckpt = Checkpointer(
        CheckpointConfig(enable=True, mode="sync"),
        out_run_dir,
        {"model": model},
        config=cfg.to_dict(),
        stage=cfg.stage.name or None,
    )
    ckpt.save(step, sync=True)
    ckpt.close()
    return Path(out_run_dir) / CheckpointConfig.folder / layout.step_dir_name(step)


@cli_errors
def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m titanloop.train.zero_import",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("ds_dir", help="DeepSpeed checkpoint folder (with `latest`) or one of its tag folders")
    p.add_argument("--config", required=True, help="training config (TOML) of the saved model")
    p.add_argument("--out", required=True, help="run dir to write <out>/checkpoints/step-N into")
    p.add_argument("--tag", default=None, help="checkpoint tag (default: the one named in `latest`)")
    p.add_argument("--overwrite", action="store_true", help="write into a run dir that holds checkpoints")
    args, overrides = p.parse_known_args(argv)
    existing = layout.published_steps(Path(args.out) / CheckpointConfig.folder)
    if existing and not args.overwrite:  # a step of the same number would be replaced
        raise ConfigError(
            f"--out={args.out!r} already holds checkpoints (step {existing[-1]}): choose a new run dir, or pass "
            "--overwrite"
        )
    step_dir = import_zero_checkpoint(args.ds_dir, args.config, args.out, args.tag, overrides)
    print(f"wrote {step_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
