"""Run a LoopLM one loop at a time, so evaluation can read every loop and stop whenever it wants.

`iter_loops` mirrors `LoopLM.forward` step for step (tests/test_eval_trace.py checks they agree for every
architecture variant), but yields after each loop instead of running all T. Each `LoopStep` carries the
readout the model would decode *if it stopped at this loop* (`exit_readout`): for readout='final_only_norm'
that is the normalized state, exactly what `model(ids, n_loops=t)` decodes at its last loop. So the static
exit at t, the depth sweep at T = t and early exit at t all use the same, correct readout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from titanloop.config_errors import require
from titanloop.model import LoopLM


@dataclass
class LoopStep:
    t: int  # 1-based loop index
    state: torch.Tensor  # [B, S, H] raw hidden state H_t after the looped block
    normed: torch.Tensor  # [B, S, H] final norm of H_t after the coda layers (if any)
    exit_readout: torch.Tensor  # [B, S, H] what the LM head decodes when the model exits at loop t
    gate_logit: torch.Tensor  # [B, S] exit-gate logit z_t, λ_t = sigmoid(z_t)
    loop_input: torch.Tensor  # [B, S, H] x_{t-1}: the input this loop received (JSRR linearizes Φ here)
    next_input: torch.Tensor  # [B, S, H] x_t: the input loop t+1 receives


def rope_and_mask(model: LoopLM, input_ids: torch.Tensor, *, kv_cache=None, position_offset: int = 0,
                  doc_ids: torch.Tensor | None = None):
    """cos, sin and attention mask exactly as LoopLM.forward builds them."""
    return model.rope_and_mask(input_ids, doc_ids=doc_ids, kv_cache=kv_cache, position_offset=position_offset)


def iter_loops(model: LoopLM, input_ids: torch.Tensor, n_loops: int, *, kv_cache=None, position_offset: int = 0,
               doc_ids: torch.Tensor | None = None) -> Iterator[LoopStep]:
    """Yield a LoopStep after each of loops 1..n_loops; the caller may stop early (break)."""
    require(int(n_loops) >= 1, "n_loops", n_loops, "an integer >= 1")
    if model.loop_norms is not None:
        require(n_loops <= len(model.loop_norms), "n_loops", n_loops,
                f"<= max_loops={len(model.loop_norms)} when per_loop_norm is on")
    cos, sin, mask = rope_and_mask(model, input_ids, kv_cache=kv_cache, position_offset=position_offset,
                                   doc_ids=doc_ids)
    x = model.embed(input_ids, cos, sin, mask, kv_cache)
    for t in range(n_loops):
        h = model.loop_step(x, t, cos, sin, mask, kv_cache)
        pre = model.head_input(h, t, cos, sin, mask, kv_cache)
        normed = model.norm(pre)
        if model.cfg.inter_loop_norm:
            nxt = normed if not model.coda else model.norm(h)
        else:
            nxt = h
        yield LoopStep(t=t + 1, state=h, normed=normed,
                       exit_readout=model.readout(pre, normed, t, t + 1),
                       gate_logit=model.early_exit_gate(normed).squeeze(-1), loop_input=x, next_input=nxt)
        x = nxt
