"""Stage transitions of Ouro's recipe: a stage starts from the previous stage's checkpoint with its own changes.

A stage config (train_configs/stage*.toml) has a `[stage]` section:
    [stage]
    name = "stage2_ct_anneal"                          # recorded in every checkpoint and in W&B
    init_from = "runs/ouro/stage1b_1p4b/checkpoints"   # previous stage: checkpoint folder, step dir or Ouro HF dir
    upcycle = "none"                                   # none | stack | interleave (L -> 2L looped layers)
    keep_optimizer = true                              # carry AdamW moments over (same shapes only)

Everything else of the new stage (loop count, β, sequence length, RoPE base, LR schedule, data mixture) is
simply the new config: only the weights — and, with keep_optimizer, the optimizer moments — come from the
previous stage. The LR schedule, step counter and data position start fresh. The previous checkpoint is used
only when the run dir has no checkpoint of its own: a preempted stage resumes from its own checkpoints.

keep_optimizer defaults to true: Ouro's stages are one continuous pretraining run with schedule changes, so
Adam's moment estimates remain valid for the same parameters. It is ignored (fresh optimizer) when upcycling
(the 2L-layer stack is a new parameter set; the offline `python -m titanloop.recipe.upcycle` duplicates the
moments of a plain DCP checkpoint if wanted) and for exit-gate Stage II (gate_stage2.toml sets it false).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from titanloop.config_errors import ConfigError, require_choice
from titanloop.model import LoopLM
from titanloop.recipe.upcycle import ORDERS, upcycle_state_dict
from titanloop.checkpoint import CheckpointConfig, Checkpointer
from titanloop.checkpoint.loading import load_model
from titanloop.checkpoint.loading import checkpoint_format
from titanloop.checkpoint import layout

log = logging.getLogger(__name__)


@dataclass
class StageSection:
    name: str = ""  # stage name; empty = $TITANLOOP_STAGE or none
    init_from: str = ""  # previous stage's checkpoint; empty = random init (the first stage)
    upcycle: str = "none"  # none | stack | interleave
    keep_optimizer: bool = True

    def validate(self):
        require_choice(self.upcycle, "stage.upcycle", ("none", *ORDERS))
        if self.upcycle != "none" and not self.init_from:
            raise ConfigError("stage.upcycle is set but stage.init_from is empty: name the checkpoint to upcycle")


def checkpoint_folder(path: str | Path) -> tuple[Path, int] | None:
    """(folder holding step-N dirs, step) of a titanloop checkpoint path, or None for an Ouro HF directory."""
    p = Path(path)
    if checkpoint_format(p) == "ouro_hf":
        return None
    if (p / layout.MANIFEST).is_file():  # a step-N dir
        return p.parent, int(p.name.split("-")[-1])
    step = layout.latest_step(p)
    if step is None:
        raise ConfigError(
            f"stage.init_from={str(p)!r} has no published checkpoint: point it at the previous "
            "stage's <run_dir>/checkpoints folder (or a step-N dir inside it)"
        )
    return p, step


def previous_stage_state(stage: StageSection, model: LoopLM) -> dict:
    """The weights the new stage starts from, shaped for `model`: loaded from stage.init_from, duplicated when
    upcycling, and checked tensor by tensor (one-line error naming the first tensor that differs)."""
    src = load_model(stage.init_from)
    old_cfg, new_cfg = src.cfg, model.cfg
    state = src.state_dict()
    if stage.upcycle != "none":
        if new_cfg.n_layers != 2 * old_cfg.n_layers:
            raise ConfigError(
                f"stage.upcycle={stage.upcycle!r} doubles the {old_cfg.n_layers} looped layers of "
                f"{stage.init_from!r}, but model.n_layers={new_cfg.n_layers}: set it to "
                f"{2 * old_cfg.n_layers}"
            )
        state = upcycle_state_dict(state, stage.upcycle)
    elif new_cfg.n_layers != old_cfg.n_layers:
        raise ConfigError(
            f"stage.init_from={stage.init_from!r} has {old_cfg.n_layers} looped layers, the new model "
            f'has model.n_layers={new_cfg.n_layers}: set stage.upcycle = "stack" (or '
            '"interleave") to duplicate layers, or use the same layer count'
        )
    live = model.state_dict()
    for key, value in live.items():
        if key not in state:
            raise ConfigError(
                f"stage.init_from={stage.init_from!r} lacks tensor {key!r} of the new model: the "
                "two stages' model configs differ in structure (prelude/coda/gates/norms)"
            )
        if tuple(state[key].shape) != tuple(value.shape):
            raise ConfigError(
                f"stage.init_from={stage.init_from!r} has {key!r} of shape {tuple(state[key].shape)}, "
                f"the new model needs {tuple(value.shape)}: the stages' model shapes differ"
            )
    extra = sorted(set(state) - set(live))
    if extra:
        raise ConfigError(
            f"stage.init_from={stage.init_from!r} has tensor {extra[0]!r} that the new model lacks "
            f"({len(extra)} extra): the two stages' model configs differ in structure"
        )
    return state


def load_stage_weights(model, stage: StageSection, state: dict) -> None:
    """Load the previous stage's full weights (from previous_stage_state) into the new stage's model, plain or
    parallelized (FSDP2 / TP: each rank keeps its shards)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=True))
    log.info(
        "stage %s: weights from %s%s",
        stage.name or "?",
        stage.init_from,
        f" (upcycled, order {stage.upcycle})" if stage.upcycle != "none" else "",
    )


def keeps_optimizer(stage: StageSection, objective_name: str) -> bool:
    return (
        stage.keep_optimizer
        and stage.upcycle == "none"
        and objective_name != "stage2_gate"
        and checkpoint_folder(stage.init_from) is not None
    )


def load_previous_stage_optimizer(stage: StageSection, optimizers, lr_schedulers) -> None:
    """Load the previous stage's optimizer state (any world size), then put the new stage's LR back on the
    param groups (the loaded state carries the previous stage's last LR)."""
    folder, step = checkpoint_folder(stage.init_from)
    source = Checkpointer(CheckpointConfig(enable=True, folder="."), folder, {"optimizer": optimizers})
    source.load(step)
    source.close()
    lr_schedulers.apply_lr()
