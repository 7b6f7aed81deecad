"""Run a LoopLM one loop at a time, so evaluation can read every loop and stop whenever it wants.

`iter_loops` is `LoopLM.loops`, the loop `LoopLM.forward` itself runs (one loop body for training and
evaluation). Each `LoopStep` carries the readout the model would decode *if it stopped at this loop*
(`exit_readout`): for readout='final_only_norm' that is the normalized state, exactly what
`model(ids, n_loops=t)` decodes at its last loop. So the static exit at t, the depth sweep at T = t and early
exit at t all use the same, correct readout.
"""

from __future__ import annotations

from typing import Iterator

import torch

from titanloop.model import LoopLM, LoopStep


def iter_loops(
    model: LoopLM,
    input_ids: torch.Tensor,
    n_loops: int,
    *,
    kv_cache=None,
    position_offset: int = 0,
    doc_ids: torch.Tensor | None = None,
) -> Iterator[LoopStep]:
    """Yield a LoopStep after each of loops 1..n_loops; the caller may stop early (break)."""
    return model.loops(input_ids, n_loops, doc_ids=doc_ids, kv_cache=kv_cache, position_offset=position_offset)


__all__ = ["LoopStep", "iter_loops"]
