"""The per-step training objective of a LoopLM and its per-loop statistics (RECIPE §3, §5).

`loop_objective` turns one forward (per-loop readouts, raw states, gate logits; full sequence) into

    loss = objective(L^(1..T), λ_1..T)  [+ scale penalty]      then, with JSRR weight λ_J > 0:
    loss = (1 − λ_J) loss + λ_J L_JSRR                          (stars §5, Alg. 1)

and a dict of fp32 statistics: per-loop CE L^(t), mean exit probability p(t), gate entropy H(p) and
per-loop hidden RMS ‖H_t‖_rms. Objectives: stage1 (ouro eq. 4), stage2_gate (ouro eqs. 5–6),
dense (DICE eq. 2), final_only (last loop's CE). Everything is in fp32 whatever the model dtype.
"""

from __future__ import annotations

import torch

from titanloop.objectives.chunked_ce import IGNORE_INDEX, per_loop_cross_entropy
from titanloop.objectives.exit_distribution import exit_entropy, exit_log_probs
from titanloop.objectives.jsrr import jsrr_loss
from titanloop.objectives.losses import (ObjectiveConfig, dense_supervision_loss, final_loop_loss, masked_mean,
                                         scale_penalty, stage1_loss, stage2_gate_loss)


def loop_statistics(ce: torch.Tensor, gate_logits: torch.Tensor, states, mask: torch.Tensor) -> dict:
    """Detached fp32 diagnostics: ce [T], exit_prob [T], gate_entropy [], hidden_rms [T]."""
    with torch.no_grad():
        log_p = exit_log_probs(gate_logits)
        rms = torch.stack([masked_mean(s.detach().float().pow(2).mean(-1).sqrt(), mask) for s in states])
        return {"ce": masked_mean(ce.detach(), mask), "exit_prob": masked_mean(log_p.exp(), mask),
                "gate_entropy": masked_mean(exit_entropy(log_p), mask), "hidden_rms": rms}


def loop_objective(cfg: ObjectiveConfig, readouts, states, gate_logits: torch.Tensor, labels: torch.Tensor,
                   lm_head_weight: torch.Tensor, jsrr_map=None, jsrr_state: torch.Tensor | None = None,
                   jsrr_probes: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """Scalar fp32 loss and statistics for one micro-batch.

    readouts/states: lists of [B, S, H] (one per loop); gate_logits [T, B, S]; labels [B, S] (-100 ignored).
    jsrr_map/jsrr_state/jsrr_probes: Φ, the state it is linearized at and the power iteration's starting
    directions (objectives.jsrr_probes; needed only when cfg.jsrr_weight > 0).
    """
    mask = labels != IGNORE_INDEX
    if cfg.name == "final_only":  # only the last loop is decoded
        ce_last = per_loop_cross_entropy(readouts[-1:], lm_head_weight, labels, cfg.ce_chunk_size)
        loss = final_loop_loss(ce_last[0], mask)
        with torch.no_grad():
            ce = per_loop_cross_entropy([r.detach() for r in readouts], lm_head_weight.detach(), labels,
                                        cfg.ce_chunk_size)
    else:
        ce = per_loop_cross_entropy(readouts, lm_head_weight, labels, cfg.ce_chunk_size)
        if cfg.name == "stage1":
            loss, _ = stage1_loss(ce, gate_logits, mask, cfg.beta, cfg.prior, cfg.geometric_eta)
        elif cfg.name == "stage2_gate":
            loss = stage2_gate_loss(ce, gate_logits, mask, cfg.gate_k, cfg.gate_gamma)
        else:
            loss = dense_supervision_loss(ce, mask, cfg.dense_alpha, cfg.dense_schedule)
    if cfg.scale_penalty > 0:
        loss = loss + scale_penalty(states, mask, cfg.scale_penalty)
    stats = loop_statistics(ce, gate_logits, states, mask)
    if cfg.jsrr_weight > 0:
        l_jsrr = jsrr_loss(jsrr_map, jsrr_state, jsrr_probes, cfg.jsrr_power_steps)
        loss = (1 - cfg.jsrr_weight) * loss + cfg.jsrr_weight * l_jsrr
        stats["jsrr"] = l_jsrr.detach()
    return loss.float(), stats
