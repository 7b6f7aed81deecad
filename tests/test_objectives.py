"""Looped-LM objectives (RECIPE §2-3) against hand computations and independent float64 references."""

import math

import pytest
import torch
import torch.nn.functional as F

from titanloop.config_errors import ConfigError
from titanloop.model import LoopLM, LoopLMConfig
from titanloop.objectives import (
    IGNORE_INDEX,
    ObjectiveConfig,
    dense_supervision_loss,
    dense_weights,
    exit_cdf,
    exit_probs,
    geometric_prior,
    jsrr_loss,
    jsrr_probes,
    jsrr_target,
    per_loop_cross_entropy,
    q_exit_steps,
    scale_penalty,
    spectral_radius_estimate,
    stage1_loss,
    stage2_gate_loss,
)


def tiny_model(**kw) -> LoopLM:
    cfg = dict(vocab_size=96, hidden_size=32, n_heads=4, ffn_hidden_size=64, n_layers=2, n_loops=3, max_seq_len=64)
    cfg.update(kw)
    return LoopLM(LoopLMConfig(**cfg))


def logit(p: float) -> float:
    return math.log(p / (1 - p))


# ----- exit distribution and Q-exit (ouro §3.2) ---------------------------------------------------------
LAMBDAS = [0.2, 0.5, 0.25, 0.6]  # λ_1..λ_4 of one token


def test_exit_probs_match_hand_computation_and_sum_to_one():
    z = torch.tensor([logit(p) for p in LAMBDAS]).view(4, 1)
    p = exit_probs(z).squeeze(1)
    # p(1)=λ1, p(2)=(1-λ1)λ2, p(3)=(1-λ1)(1-λ2)λ3, p(4)=S_3 (λ4 is ignored: the last loop takes the rest)
    hand = [0.2, 0.8 * 0.5, 0.8 * 0.5 * 0.25, 0.8 * 0.5 * 0.75]
    torch.testing.assert_close(p, torch.tensor(hand), rtol=1e-6, atol=1e-7)
    many = exit_probs(torch.randn(6, 5, 7) * 4)
    torch.testing.assert_close(many.sum(0), torch.ones(5, 7), rtol=0, atol=1e-6)
    assert (many >= 0).all()


def test_exit_cdf_and_q_exit_pick_the_documented_step():
    z = torch.tensor([logit(p) for p in LAMBDAS]).view(4, 1)
    cdf = exit_cdf(z).squeeze(1)
    torch.testing.assert_close(cdf, torch.tensor([0.2, 0.6, 0.7, 1.0]), rtol=1e-6, atol=1e-7)
    picks = {q: int(q_exit_steps(z, q)) for q in (0.0, 0.1, 0.19, 0.21, 0.59, 0.61, 0.69, 0.71, 0.9, 1.0)}
    assert picks == {0.0: 1, 0.1: 1, 0.19: 1, 0.21: 2, 0.59: 2, 0.61: 3, 0.69: 3, 0.71: 4, 0.9: 4, 1.0: 4}
    # per token: a confident first gate exits at once, a closed gate runs to T
    zz = torch.tensor([[8.0, -8.0], [0.0, -8.0], [0.0, -8.0]])
    assert q_exit_steps(zz, 0.99).tolist() == [1, 3]
    with pytest.raises(ConfigError, match="q="):
        q_exit_steps(z, 1.5)


# ----- Stage I against a float64 reference with fully materialized per-loop logits ------------------------
def stage1_reference(readouts, gate_logits, head, targets, beta, prior=None):
    """Independent float64 Stage I: full [T, B, S, V] logits, explicit survival products, explicit entropy."""
    w = head.double()
    T = len(readouts)
    lam = torch.sigmoid(gate_logits.double())  # [T, B, S]
    p, survive = [], torch.ones_like(lam[0])
    for t in range(T):
        p.append(survive if t == T - 1 else lam[t] * survive)
        survive = survive * (1 - lam[t])
    p = torch.stack(p)
    ce = []
    for r in readouts:
        logits = r.double() @ w.t()  # [B, S, V]
        logprobs = logits - logits.logsumexp(-1, keepdim=True)
        ce.append(-logprobs.gather(-1, targets.clamp_min(0)[..., None]).squeeze(-1))
    ce = torch.stack(ce)
    valid = (targets != IGNORE_INDEX).double()
    if prior is None:
        reg = (p * p.log()).sum(0)  # -H(p)
    else:
        reg = (p * (p.log() - prior.double().view(-1, 1, 1).log())).sum(0)
    per_token = (p * ce).sum(0) + beta * reg
    return (per_token * valid).sum() / valid.sum()


def _leaves(model, ids):
    out = model(ids)
    readouts = [r.detach().requires_grad_(True) for r in out.readouts]
    return readouts, out.gate_logits.detach().requires_grad_(True)


def test_stage1_equals_float64_reference_on_tiny_model():
    torch.manual_seed(1)
    model = tiny_model(n_loops=4)
    with torch.no_grad():
        model.early_exit_gate.weight.normal_(std=0.5)  # a non-trivial exit distribution
    ids = torch.randint(0, 96, (2, 12))
    targets = torch.randint(0, 96, (2, 12))
    targets[0, :3] = IGNORE_INDEX
    readouts, z = _leaves(model, ids)
    head = model.lm_head.weight.detach()
    ce = per_loop_cross_entropy(readouts, head, targets, chunk_size=5)
    loss, stats = stage1_loss(ce, z, targets != IGNORE_INDEX, beta=0.1)
    loss.backward()
    r64 = [r.detach().double().requires_grad_(True) for r in readouts]
    z64 = z.detach().double().requires_grad_(True)
    ref = stage1_reference(r64, z64, head, targets, beta=0.1)
    ref.backward()
    assert abs(loss.item() - ref.item()) < 1e-5 * max(1.0, abs(ref.item()))
    torch.testing.assert_close(z.grad.double(), z64.grad, rtol=1e-4, atol=1e-7)  # gradient into the gate
    for r, r_ref in zip(readouts, r64):  # and into every loop's readout
        torch.testing.assert_close(r.grad.double(), r_ref.grad, rtol=1e-4, atol=1e-7)
    assert 0 < stats["gate_entropy"] <= math.log(4) + 1e-6


def test_stage1_geometric_prior_matches_kl_reference():
    eta = 0.3
    prior = geometric_prior(4, eta)
    hand = torch.tensor([eta * (1 - eta) ** k for k in range(4)])
    torch.testing.assert_close(prior, hand / hand.sum())
    assert prior[0] > prior[-1]
    torch.manual_seed(2)
    model = tiny_model(n_loops=4)
    ids, targets = torch.randint(0, 96, (2, 10)), torch.randint(0, 96, (2, 10))
    readouts, z = _leaves(model, ids)
    head = model.lm_head.weight.detach()
    ce = per_loop_cross_entropy(readouts, head, targets, chunk_size=7)
    loss, _ = stage1_loss(ce, z, torch.ones_like(targets, dtype=torch.bool), beta=0.05, prior="geometric", eta=eta)
    ref = stage1_reference(readouts, z, head, targets, beta=0.05, prior=prior)
    assert abs(loss.item() - ref.item()) < 1e-5 * max(1.0, abs(ref.item()))


def test_stage1_uniform_prior_is_elbo_up_to_log_t():
    """Eq. 4 with the entropy equals the KL-to-uniform form minus β log T (ouro §3.3)."""
    ce, z = torch.rand(3, 2, 5) * 4, torch.randn(3, 2, 5)
    mask = torch.ones(2, 5, dtype=torch.bool)
    ent, _ = stage1_loss(ce, z, mask, beta=0.2)
    p = exit_probs(z)
    kl = (p * (p.log() + math.log(3))).sum(0)
    torch.testing.assert_close(ent, ((p * ce).sum(0) + 0.2 * kl).mean() - 0.2 * math.log(3))


# ----- Stage II (ouro §3.4, eqs. 5-6) ----------------------------------------------------------------
def test_stage2_value_matches_hand_reference():
    k, gamma = 50.0, 0.005
    ce = torch.tensor([[3.0, 2.0], [2.5, 2.001], [2.6, 1.5]]).view(3, 1, 2)  # [T, B, S]
    z = torch.tensor([[0.3, -0.2], [1.0, -1.5], [-0.4, 0.7]]).view(3, 1, 2)
    mask = torch.ones(1, 2, dtype=torch.bool)
    total = 0.0
    for t in (1, 2):  # loops 2..T (0-based 1..T-1)
        per_tok = []
        for i in range(2):
            improvement = max(0.0, ce[t - 1, 0, i].item() - ce[t, 0, i].item())
            w = 1 / (1 + math.exp(-k * (improvement - gamma)))
            lam = 1 / (1 + math.exp(-z[t, 0, i].item()))
            per_tok.append(-(w * math.log(1 - lam) + (1 - w) * math.log(lam)))
        total += sum(per_tok) / 2
    hand = total / 3  # divided by T_max (the paper's normalization)
    got = stage2_gate_loss(ce, z, mask, k=k, gamma=gamma)
    assert abs(got.item() - hand) < 1e-5


def test_stage2_gradients_reach_only_the_gate():
    torch.manual_seed(3)
    model = tiny_model(n_loops=3)
    ids, targets = torch.randint(0, 96, (2, 8)), torch.randint(0, 96, (2, 8))
    for name, p in model.named_parameters():  # Stage II: the LM is frozen, only the exit gate trains
        p.requires_grad_(name.startswith("early_exit_gate."))
    out = model(ids)
    ce = per_loop_cross_entropy(out.readouts, model.lm_head.weight, targets)
    ce_leaf = ce.detach().requires_grad_(True)  # to see whether the loss lets gradient into the LM losses
    loss = stage2_gate_loss(ce_leaf, out.gate_logits, torch.ones_like(targets, dtype=torch.bool))
    loss.backward()
    assert ce_leaf.grad is None  # the per-loop LM losses are detached inside the loss
    for name, p in model.named_parameters():
        if name.startswith("early_exit_gate."):
            assert p.grad is not None and p.grad.abs().sum() > 0, name
        else:
            assert p.grad is None, name
    with pytest.raises(ConfigError, match="n_loops"):
        stage2_gate_loss(ce[:1], out.gate_logits[:1], torch.ones_like(targets, dtype=torch.bool))


# ----- DICE dense supervision and the scale penalty -----------------------------------------------------
def test_dense_schedule_weights():
    torch.testing.assert_close(dense_weights(4, "uniform"), torch.tensor([1 / 3, 1 / 3, 1 / 3]))
    torch.testing.assert_close(dense_weights(4, "linear"), torch.tensor([1 / 6, 2 / 6, 3 / 6]))
    torch.testing.assert_close(dense_weights(4, "exponential"), torch.tensor([2 / 14, 4 / 14, 8 / 14]))
    assert dense_weights(1, "linear").numel() == 0
    ce = torch.tensor([4.0, 3.0, 2.5, 2.0]).view(4, 1, 1).expand(4, 2, 3)
    mask = torch.ones(2, 3, dtype=torch.bool)
    got = dense_supervision_loss(ce, mask, alpha=0.5, schedule="linear")
    assert abs(got.item() - (2.0 + 0.5 * (4 / 6 + 6 / 6 + 7.5 / 6))) < 1e-6
    with pytest.raises(ConfigError, match="dense_schedule"):
        dense_weights(4, "cosine")


def test_scale_penalty_hand_value():
    states = [torch.full((1, 2, 4), 2.0), torch.full((1, 2, 4), 3.0)]
    states[1][0, 1] = 100.0  # an ignored token must not count
    mask = torch.tensor([[True, False]])
    got = scale_penalty(states, mask, weight=0.01)
    assert abs(got.item() - 0.01 * (4.0 + 9.0) / 2) < 1e-7


# ----- STARS Jacobian spectral-radius regularization -----------------------------------------------------
def test_jsrr_on_linear_map_with_known_spectral_radius():
    torch.manual_seed(4)
    h = 6
    q, _ = torch.linalg.qr(torch.randn(h, h, dtype=torch.float64))
    eig = torch.tensor([1.7, -0.9, 0.5, 0.3, 0.2, 0.1], dtype=torch.float64)
    a = (q @ torch.diag(eig) @ q.t()).float()  # symmetric, spectral radius 1.7
    phi = lambda x: x @ a.t()  # noqa: E731 - J_Φ is block-diagonal with A on every token
    x = torch.randn(3, 4, h)
    rho = spectral_radius_estimate(phi, x, power_steps=200, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(rho, torch.full((3,), 1.7), rtol=1e-3, atol=0)

    # one power step: L = mean_b ‖A v_b‖² with v_b a unit random direction over the sample's whole state
    probes = jsrr_probes(x.shape, torch.tensor([10, 11, 12]), seed=7)
    loss = jsrr_loss(phi, x, probes, power_steps=1)
    v = probes / probes.flatten(1).norm(dim=1).view(-1, 1, 1)
    ref = (v @ a.t()).flatten(1).pow(2).sum(1).mean()
    torch.testing.assert_close(loss, ref, rtol=1e-4, atol=0)
    assert loss <= 1.7**2 + 1e-5


def test_jsrr_probes_depend_on_the_sample_not_on_the_rank_or_batch():
    shape = (4, 3, 8)
    whole = jsrr_probes(shape, torch.tensor([20, 21, 22, 23]), seed=1)
    # split over 2 data-parallel ranks, or over 2 micro-batches in another order: the same row per sample
    parts = torch.cat(
        [jsrr_probes((2, 3, 8), torch.tensor([20, 21]), 1), jsrr_probes((2, 3, 8), torch.tensor([22, 23]), 1)]
    )
    assert torch.equal(whole, parts)
    assert torch.equal(jsrr_probes((1, 3, 8), torch.tensor([22]), 1)[0], whole[2])
    # every sample (so every rank) its own direction; another seed, other directions
    flat = whole.flatten(1)
    assert all(not torch.allclose(flat[i], flat[j]) for i in range(4) for j in range(i))
    assert not torch.allclose(jsrr_probes(shape, torch.tensor([20, 21, 22, 23]), seed=2), whole)


def test_jsrr_through_the_real_model_reaches_parameters():
    torch.manual_seed(5)
    model = tiny_model(n_loops=2)
    ids = torch.randint(0, 96, (2, 8))
    out = model(ids)
    cos, sin = model.rope(8, ids.device, torch.float32)
    phi = lambda x: model.recurrent_map(x, 1, cos, sin)  # noqa: E731
    loss = jsrr_loss(phi, out.next_input, jsrr_probes(out.next_input.shape, torch.arange(2), 0), power_steps=2)
    assert torch.isfinite(loss) and loss > 0
    loss.backward()
    for name in ("layers.0.self_attn.q_proj.weight", "layers.1.mlp.down_proj.weight", "embed_tokens.weight"):
        g = dict(model.named_parameters())[name].grad
        assert g is not None and g.abs().sum() > 0, name


@pytest.mark.parametrize("n_loops", [2, 3])
def test_jsrr_linearizes_a_transition_of_the_forward_checked_against_the_direct_jacobian(n_loops):
    """Per-loop norms, max_loops = 3: at T = 2 JSRR takes loop 3's map at x_2 (stars Alg. 1: the Jacobian of the
    next application), at T = 3 = max_loops (no loop 4 exists) loop 3's map at its input x_2. In both cases
    Φ(state) must be a state the forward computes, and L_JSRR must equal ‖J v̂‖² with J the full Jacobian
    computed directly by reverse-mode autograd (not by the JVP the loss uses)."""
    torch.manual_seed(8)
    model = tiny_model(
        n_loops=3, max_loops=3, per_loop_norm=True, hidden_size=16, n_heads=2, ffn_hidden_size=32
    ).double()
    with torch.no_grad():  # per-loop norm scales that differ, so the loop index matters
        for norm in model.loop_norms:
            norm.weight.uniform_(0.5, 1.5)
    ids = torch.randint(0, 96, (2, 3))
    out = model(ids, n_loops)
    phi, state = jsrr_target(model, out, ids, None, n_loops)
    # Φ(state) is the next state of the forward: x_{T+1} of a (T+1)-loop forward, or x_T at T == max_loops
    expected = model(ids, n_loops + 1).next_input if n_loops < 3 else out.next_input
    torch.testing.assert_close(phi(state), expected, rtol=0, atol=1e-12)
    probes = jsrr_probes(state.shape, torch.tensor([0, 1]), seed=3).double()
    loss = jsrr_loss(phi, state, probes, power_steps=1)
    d = state[0].numel()
    direct = []
    for i in range(2):  # one sample's Jacobian: its [S*H, S*H] block (samples do not interact)
        row = lambda x, i=i: phi(torch.cat([state[:i], x.view(1, *state.shape[1:]), state[i + 1 :]]))[i]  # noqa: E731
        jac = torch.autograd.functional.jacobian(row, state[i].reshape(-1)).reshape(d, d)
        v = probes[i].reshape(-1) / probes[i].norm()
        direct.append((jac @ v).pow(2).sum())
    torch.testing.assert_close(loss.double(), torch.stack(direct).mean(), rtol=1e-6, atol=0)


# ----- chunked cross-entropy ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_ce_equals_unchunked_values_and_grads(dtype):
    torch.manual_seed(6)
    n, h, v = 37, 16, 103
    hidden = torch.randn(n, h, dtype=dtype, requires_grad=True)
    weight = (torch.randn(v, h) * 0.3).to(dtype).requires_grad_(True)
    targets = torch.randint(0, v, (n,))
    targets[::5] = IGNORE_INDEX
    upstream = torch.rand(n)

    from titanloop.objectives import linear_cross_entropy

    loss_c = linear_cross_entropy(hidden, weight, targets, chunk_size=8)
    (loss_c * upstream).sum().backward()
    gh_c, gw_c = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    logits = (hidden @ weight.t()).float()  # the plain, unchunked cross-entropy
    loss_d = F.cross_entropy(logits, targets, reduction="none", ignore_index=IGNORE_INDEX)
    (loss_d * upstream).sum().backward()

    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(loss_c, loss_d, **tol)
    assert (loss_c[::5] == 0).all() and (gh_c[::5] == 0).all()
    torch.testing.assert_close(gh_c.float(), hidden.grad.float(), **tol)
    torch.testing.assert_close(gw_c.float(), weight.grad.float(), **tol)
    assert gh_c.dtype == dtype and gw_c.dtype == dtype


def test_per_loop_ce_is_chunk_size_invariant():
    torch.manual_seed(7)
    model = tiny_model(n_loops=3)
    ids, targets = torch.randint(0, 96, (2, 9)), torch.randint(0, 96, (2, 9))
    out = model(ids, return_logits="all")
    a = per_loop_cross_entropy(out.readouts, model.lm_head.weight, targets, chunk_size=4)
    b = torch.stack(
        [F.cross_entropy(lg.reshape(-1, 96), targets.reshape(-1), reduction="none").view(2, 9) for lg in out.logits]
    )
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# ----- bad objective configs ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "field,kwargs",
    [
        ("objective.beta", dict(beta=-0.1)),
        ("objective.gate_k", dict(gate_k=0)),
        ("objective.gate_k", dict(gate_k=-5)),
        ("objective.prior", dict(prior="laplace")),
        ("objective.geometric_eta", dict(geometric_eta=1.0)),
        ("objective.name", dict(name="stage3")),
        ("objective.dense_schedule", dict(dense_schedule="cosine")),
        ("objective.jsrr_weight", dict(jsrr_weight=1.5)),
        ("objective.ce_chunk_size", dict(ce_chunk_size=0)),
    ],
)
def test_bad_objective_config_is_one_line_naming_the_field(field, kwargs):
    with pytest.raises(ConfigError) as e:
        ObjectiveConfig(**kwargs)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(field + "=") and "expected" in msg
