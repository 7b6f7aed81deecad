"""Layer-duplication upcycling: turn an L-layer looped stack into a 2L-layer one (ouro §4, stage 1b, 2.6B fork).

Two orders (choose with `order`):
- "stack"      new stack = [1..L, 1..L]: the 2L-layer stack computes the original stack twice in a row, so
               one upcycled loop equals two original loops minus the inter-loop norm between them. Default:
               closest to the function the checkpoint already computes.
- "interleave" new stack = [1,1,2,2,...,L,L]: each layer is immediately followed by its copy.

Works on any flat state dict whose looped-layer keys contain `layers.<i>.` after a `.` or `/` (model weights,
and optimizer state flattened the way torch.distributed.checkpoint stores it, e.g.
`optimizer/state.layers.3.mlp...exp_avg`):
every such key is copied to the new indices; everything else (embeddings, norms, gate, LM head, prelude/coda
layers, which are named `prelude.<i>` / `coda.<i>`) is kept as is. Optimizer moments are duplicated with their
layer, so Adam continues from the same per-parameter statistics; pass drop_optimizer=True to reset instead.

Entry points: `upcycle_state_dict` (in memory), `upcycle_model`, `upcycle_hf_dir` (an Ouro HF directory, or a
titanloop training checkpoint, written out as an Ouro HF directory), `upcycle_dcp` (a plain DCP directory:
weights and optimizer moments duplicated), and the CLI `python -m titanloop.recipe.upcycle`.
In a staged run, `[stage] upcycle = "stack"` does the same in memory when the stage starts (titanloop.recipe.stages);
there the optimizer starts fresh for the 2L-layer stack.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch

from titanloop.config_errors import ConfigError, cli_errors, require_choice
from titanloop.checkpoint.safe_reader import read_dcp_entries
from titanloop.interchange.ouro_hf import export_ouro_hf
from titanloop.checkpoint.loading import load_model
from titanloop.model import LoopLM

ORDERS = ("stack", "interleave")
_LAYER_KEY = re.compile(r"(^|[./])layers\.(\d+)\.")


def new_layer_sources(n_layers: int, order: str) -> list[int]:
    """Index of the original layer each of the 2L new layers copies (0-based)."""
    require_choice(order, "upcycle order", ORDERS)
    if order == "stack":
        return list(range(n_layers)) * 2
    return [i for i in range(n_layers) for _ in range(2)]


def count_layers(keys) -> int:
    idx = {int(m.group(2)) for k in keys if (m := _LAYER_KEY.search(k))}
    if not idx:
        raise ConfigError("upcycle: no looped-layer keys ('layers.<i>.') found in the checkpoint")
    n = max(idx) + 1
    if idx != set(range(n)):
        raise ConfigError(
            f"upcycle: layer indices are not contiguous 0..{n - 1}: missing {sorted(set(range(n)) - idx)}"
        )
    return n


def upcycle_state_dict(
    state: dict, order: str = "stack", drop_optimizer: bool = False, optimizer_prefix: str = "optimizer"
) -> dict:
    """Return a new flat state dict with the looped stack duplicated (tensors are cloned, never aliased)."""
    n = count_layers(state.keys())
    sources = new_layer_sources(n, order)
    by_src: dict[int, list[int]] = {}
    for new_i, src in enumerate(sources):
        by_src.setdefault(src, []).append(new_i)
    out = {}
    for key, value in state.items():
        if drop_optimizer and key.startswith(optimizer_prefix):
            continue
        m = _LAYER_KEY.search(key)
        if m is None:
            out[key] = value
            continue
        src = int(m.group(2))
        for new_i in by_src[src]:
            new_key = key[: m.start(2)] + str(new_i) + key[m.end(2) :]
            out[new_key] = value.clone() if isinstance(value, torch.Tensor) else value
    return out


def upcycle_model(model, order: str = "stack"):
    """An in-memory LoopLM -> a new LoopLM with 2L looped layers (same other config)."""
    cfg = model.cfg.replace(n_layers=2 * model.cfg.n_layers)
    new = LoopLM(cfg)
    new.load_state_dict(upcycle_state_dict(model.state_dict(), order), strict=True)
    return new


def upcycle_hf_dir(src: str | Path, dst: str | Path, order: str = "stack") -> Path:
    """An Ouro HF directory or a titanloop training checkpoint (L layers) -> an Ouro HF directory with 2L."""
    dst = Path(dst)
    if dst.exists() and any(dst.iterdir()):
        raise ConfigError(f"upcycle: destination {dst} exists and is not empty; choose a new directory")
    model = load_model(src)
    export_ouro_hf(upcycle_model(model, order), dst, allow_variant=True)  # a variant stays a variant
    return dst


def upcycle_dcp(src: str | Path, dst: str | Path, order: str = "stack", drop_optimizer: bool = False) -> Path:
    """A DCP checkpoint directory -> a new DCP directory with the looped stack duplicated (no process group
    needed; the output reshards on load like any DCP checkpoint)."""
    import torch.distributed.checkpoint as dcp

    src, dst = Path(src), Path(dst)
    if not (src / ".metadata").is_file():
        raise ConfigError(f"upcycle: {src} is not a DCP checkpoint (no .metadata file)")
    if dst.exists() and any(dst.iterdir()):
        raise ConfigError(f"upcycle: destination {dst} exists and is not empty; choose a new directory")
    # tensors and plain-data entries (numbers, strings), read without executing anything the files contain
    state = read_dcp_entries(src)
    new_state = upcycle_state_dict(state, order, drop_optimizer)
    dst.mkdir(parents=True, exist_ok=True)
    dcp.save(new_state, checkpoint_id=str(dst), no_dist=True)
    return dst


@cli_errors
def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m titanloop.recipe.upcycle",
        description="Duplicate the looped layers of a checkpoint (L -> 2L layers), as Ouro's 2.6B fork does "
        "(24 -> 48). Works on an exported Ouro HF directory or a DCP checkpoint directory.",
    )
    p.add_argument(
        "src",
        help="source: an Ouro HF directory (config.json), a titanloop training checkpoint "
        "(step-N dir or the checkpoints folder with `latest`; written out as an Ouro HF "
        "directory), or a plain DCP directory (.metadata; written out as DCP)",
    )
    p.add_argument("dst", help="new directory to write (must not exist or be empty)")
    p.add_argument(
        "--order", choices=ORDERS, default="stack", help="stack = [1..L,1..L] (default), interleave = [1,1,2,2,...]"
    )
    p.add_argument(
        "--drop-optimizer",
        action="store_true",
        help="DCP only: drop optimizer state instead of duplicating it with its layer",
    )
    a = p.parse_args(argv)
    src = Path(a.src)
    if (src / "config.json").is_file() or (src / "latest").is_file() or (src / "titanloop.json").is_file():
        out = upcycle_hf_dir(src, a.dst, a.order)
    elif (src / ".metadata").is_file():
        out = upcycle_dcp(src, a.dst, a.order, a.drop_optimizer)
    else:
        raise ConfigError(
            f"upcycle: {src} is neither an Ouro HF directory (config.json) nor a DCP checkpoint (.metadata)"
        )
    print(f"wrote upcycled checkpoint ({a.order} order) to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
