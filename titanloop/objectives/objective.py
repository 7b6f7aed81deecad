"""The per-step training objective of a LoopLM and its per-loop statistics (RECIPE §3, §5).

`loop_objective` turns one forward (per-loop readouts, raw states, gate logits; full sequence) into

    loss = objective(L^(1..T), λ_1..T)  [+ scale penalty]      then, with JSRR weight λ_J > 0:
    loss = (1 − λ_J) loss + λ_J L_JSRR                          (stars §5, Alg. 1)

and a dict of fp32 statistics: per-loop CE L^(t), mean exit probability p(t), gate entropy H(p) and
per-loop hidden RMS ‖H_t‖_rms. Objectives: stage1 (ouro eq. 4), stage2_gate (ouro eqs. 5–6),
dense (DICE eq. 2), final_only (last loop's CE). Everything is in fp32 whatever the model dtype.

Stage I, dense and final_only are linear in the per-loop CE: loss = Σ_t,b,s w[t,b,s] L^(t)[b,s] + rest, with
w known before the CE. With cfg.ce_backward = "fused" the CE and its gradients come out of one pass over each
loop's logits (chunked_ce.fused_per_loop_cross_entropy); "recompute" forms Σ w L from per_loop_cross_entropy,
whose backward recomputes the logits. Stage II detaches the CE, so it is computed without a graph.
"""

from __future__ import annotations

import torch

from titanloop.objectives.chunked_ce import IGNORE_INDEX, fused_per_loop_cross_entropy, per_loop_cross_entropy
from titanloop.objectives.exit_distribution import exit_entropy, exit_log_probs
from titanloop.objectives.jsrr import jsrr_loss
from titanloop.objectives.losses import (
    ObjectiveConfig,
    dense_loop_coefficients,
    masked_mean,
    scale_penalty,
    stage1_linear_terms,
    stage2_gate_loss,
    token_weights,
)


def loop_statistics(ce: torch.Tensor, gate_logits: torch.Tensor, states, mask: torch.Tensor) -> dict:
    """Detached fp32 diagnostics: ce [T], exit_prob [T], gate_entropy [], hidden_rms [T]."""
    with torch.no_grad():
        log_p = exit_log_probs(gate_logits)
        rms = torch.stack([masked_mean(s.detach().float().pow(2).mean(-1).sqrt(), mask) for s in states])
        return {
            "ce": masked_mean(ce.detach(), mask),
            "exit_prob": masked_mean(log_p.exp(), mask),
            "gate_entropy": masked_mean(exit_entropy(log_p), mask),
            "hidden_rms": rms,
        }


def _ce_weights(cfg: ObjectiveConfig, gate_logits: torch.Tensor, mask: torch.Tensor, n_loops: int):
    """(w, rest) with the objective = Σ w L + rest: w [T, B, S] over the decoded loops (only the last for
    final_only), rest a scalar (Stage I's regularizer, else 0). The losses.py functions are the reference:
    stage1_loss, dense_supervision_loss and final_loop_loss of the same CE give the same value."""
    if cfg.name == "stage1":
        return stage1_linear_terms(gate_logits, mask, cfg.beta, cfg.prior, cfg.geometric_eta)
    tok = token_weights(mask)
    if cfg.name == "final_only":
        return tok[None], 0.0
    coef = dense_loop_coefficients(n_loops, cfg.dense_alpha, cfg.dense_schedule, tok.device, cfg.dense_reduction)
    return coef.view(-1, 1, 1) * tok, 0.0


def loop_objective(
    cfg: ObjectiveConfig,
    readouts,
    states,
    gate_logits: torch.Tensor,
    labels: torch.Tensor,
    lm_head_weight: torch.Tensor,
    jsrr_map=None,
    jsrr_state: torch.Tensor | None = None,
    jsrr_probes: torch.Tensor | None = None,
    statistics: bool = True,
    loop_change: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict]:
    """Scalar fp32 loss and statistics for one micro-batch.

    readouts/states: lists of [B, S, H] (one per loop); gate_logits [T, B, S]; labels [B, S] (-100 ignored).
    jsrr_map/jsrr_state/jsrr_probes: Φ, the state it is linearized at and the power iteration's starting
    directions (objectives.jsrr_probes; needed only when cfg.jsrr_weight > 0).
    statistics=False: the loss alone, with {} for statistics (the trainer's steps that log nothing); the loss is
    the same either way.
    loop_change: [B, S], the relative change one more loop makes to each token's state (LoopLM.loop_change;
    needed only when cfg.fixed_point_weight > 0): the penalty adds fixed_point_weight times its masked mean square.
    """
    mask = labels != IGNORE_INDEX
    if cfg.name == "stage2_gate":  # the LM losses are detached: no readout gradient, so no CE backward
        with torch.no_grad():
            ce = per_loop_cross_entropy(readouts, lm_head_weight, labels, cfg.ce_chunk_size)
        loss = stage2_gate_loss(ce, gate_logits, mask, cfg.gate_k, cfg.gate_gamma)
    else:  # linear in the per-loop CE: loss = Σ_t,b,s w[t,b,s] L^(t)[b,s] + rest
        decoded = readouts[-1:] if cfg.name == "final_only" else readouts  # final_only decodes the last loop
        w, rest = _ce_weights(cfg, gate_logits, mask, len(readouts))
        if cfg.ce_backward == "fused":
            loss, ce = fused_per_loop_cross_entropy(decoded, lm_head_weight, labels, w, cfg.ce_chunk_size)
        else:
            ce = per_loop_cross_entropy(decoded, lm_head_weight, labels, cfg.ce_chunk_size)
            loss = (w * ce).sum()
        loss = loss + rest
        if cfg.name == "final_only" and statistics:  # statistics of the loops that were not decoded
            with torch.no_grad():
                ce = (
                    torch.cat(
                        [per_loop_cross_entropy(readouts[:-1], lm_head_weight, labels, cfg.ce_chunk_size), ce.detach()]
                    )
                    if len(readouts) > 1
                    else ce.detach()
                )
    if cfg.scale_penalty > 0:
        loss = loss + scale_penalty(states, mask, cfg.scale_penalty)
    if cfg.fixed_point_weight > 0:
        change = masked_mean(loop_change.float().pow(2), mask)
        loss = loss + cfg.fixed_point_weight * change
    stats = loop_statistics(ce, gate_logits, states, mask) if statistics else {}
    if cfg.fixed_point_weight > 0 and statistics:
        stats["loop_change"] = masked_mean(loop_change.detach().float(), mask)
    if cfg.jsrr_weight > 0:
        l_jsrr = jsrr_loss(jsrr_map, jsrr_state, jsrr_probes, cfg.jsrr_power_steps)
        loss = (1 - cfg.jsrr_weight) * loss + cfg.jsrr_weight * l_jsrr
        if statistics:
            stats["jsrr"] = l_jsrr.detach()
    return loss.float(), stats
