"""titanloop.eval: trace == forward, depth sweep on a model whose per-loop losses are known by construction,
exit rules on crafted trajectories, Pareto frontier, bad input."""

import math

import pytest
import torch

from titanloop.config_errors import ConfigError
from titanloop.eval import EvalConfig, depth_sweep, evaluate, exit_frontier, iter_loops, pareto_front
from titanloop.eval.exits import ash_exit, below_for, hidden_diff_exit, margin_exit, q_exit
from titanloop.model import LoopLM, LoopLMConfig, preset

V = 16  # vocab = hidden: token i embeds to the i-th basis vector
SCALES = [0.5, 1.0, 2.0, 3.0, 5.0, 8.0]  # c_t: the readout at loop t is c_t * u, logits c_t * onehot(next)
GATE_BIAS = math.log(0.25 / 0.75)  # λ_t = 0.25 at every loop


def crafted_model() -> LoopLM:
    """Identity layers (zero o_proj/down_proj), per-loop norm weights c_t, raw readout, inter-loop norm:
    H_t = c_t * u with u = normalize(embed(token)), so the logits at loop t are c_t * onehot(token + 1)."""
    cfg = LoopLMConfig(
        vocab_size=V,
        hidden_size=V,
        n_heads=2,
        ffn_hidden_size=8,
        n_layers=1,
        n_loops=3,
        max_loops=len(SCALES),
        max_seq_len=64,
        readout="raw",
        per_loop_norm=True,
    )
    m = LoopLM(cfg)
    with torch.no_grad():
        m.embed_tokens.weight.copy_(torch.eye(V) * 3.0)  # any scale: RMSNorm removes it
        for layer in m.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        for t, c in enumerate(SCALES):
            m.loop_norms[t].weight.fill_(c)
        # u_i = sqrt(V) e_i; logits_j = W_j . (c u_i) = c [j == i+1 mod V]
        m.lm_head.weight.copy_(torch.roll(torch.eye(V), 1, dims=0) / math.sqrt(V))
        m.early_exit_gate.weight.zero_()
        m.early_exit_gate.bias.fill_(GATE_BIAS)
    return m.eval()


def expected_ce(c: float) -> float:
    return math.log(math.exp(c) + V - 1) - c


def counting_data(rows=6, length=12):
    g = torch.Generator().manual_seed(1)
    starts = torch.randint(0, V, (rows,), generator=g)
    return [[(int(s) + i) % V for i in range(length)] for s in starts]


def test_depth_sweep_matches_losses_known_by_construction():
    sweep = depth_sweep(crafted_model(), counting_data(), loops=[1, 2, 3, 4, 6])
    assert [p["loops"] for p in sweep["points"]] == [1, 2, 3, 4, 6]
    for p in sweep["points"]:
        c = SCALES[p["loops"] - 1]
        assert p["loss"] == pytest.approx(expected_ce(c), rel=1e-4)
        assert p["perplexity"] == pytest.approx(math.exp(expected_ce(c)), rel=1e-4)
        assert p["token_accuracy"] == 1.0 and p["sequence_accuracy"] == 1.0  # argmax is always the next token
    assert sweep["trained_loops"] == 3


def test_frontier_and_diagnostics_on_crafted_model():
    report = evaluate(
        crafted_model(),
        counting_data(),
        EvalConfig(loops=[1, 2, 3], hidden_eps=[1e-3], jsrr_loops=[1, 2], jsrr_power_steps=3),
    )
    pts = report["exit_frontier"]["points"]
    by = {(p["strategy"], tuple(sorted(p["param"].items()))): p for p in pts}
    # Q-exit with λ = 0.25 every loop: CDF(t) = 1 - 0.75^t = 0.25, 0.4375, 1 (T = 3)
    assert by[("q_exit", (("q", 0.0),))]["avg_loops"] == 1.0
    assert by[("q_exit", (("q", 0.3),))]["avg_loops"] == 2.0
    assert by[("q_exit", (("q", 0.5),))]["avg_loops"] == 3.0
    assert by[("q_exit", (("q", 1.0),))]["avg_loops"] == 3.0
    assert by[("q_exit", (("q", 0.3),))]["loss"] == pytest.approx(expected_ce(SCALES[1]), rel=1e-4)
    # the normalized state never changes (x_t = u), so the hidden-difference rule fires at loop 2
    assert by[("hidden_diff", (("eps", 1e-3),))]["avg_loops"] == 2.0
    # static points are the sweep; lower loss needs more loops, so every static point is on the loss frontier
    front = [pts[i] for i in report["exit_frontier"]["pareto"]["loss"]]
    assert [p["avg_loops"] for p in front] == sorted(p["avg_loops"] for p in front)
    assert {p["param"]["t"] for p in front if p["strategy"] == "static"} == {1, 2, 3}
    d = report["diagnostics"]
    for row, c in zip(d["hidden_rms"], SCALES):
        assert row["mean"] == pytest.approx(c, rel=1e-4) and row["max"] == pytest.approx(c, rel=1e-4)
    ex = d["exit_distribution"]
    assert ex["p_mean"] == pytest.approx([0.25, 0.1875, 0.5625], abs=1e-5)
    assert ex["mean_exit_loop"] == pytest.approx(0.25 + 2 * 0.1875 + 3 * 0.5625, abs=1e-5)
    # raw readout: the CE sees scale, so the radial fraction is far from the ~1e-8 of RMSNorm readouts
    assert all(r["mean_abs"] > 1e-3 for r in d["radial_gradient_fraction"])
    assert [r["loop"] for r in d["spectral_radius"]] == [1, 2]


def test_radial_fraction_is_tiny_for_rmsnorm_readout():
    m = LoopLM(preset("debug-tiny", vocab_size=64, n_layers=1))
    report = evaluate(
        m, [list(range(i, i + 10)) for i in range(4)], EvalConfig(loops=[1, 2], jsrr_loops=[1], jsrr_power_steps=2)
    )
    assert all(r["mean_abs"] < 1e-4 for r in report["diagnostics"]["radial_gradient_fraction"])


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"readout": "final_only_norm"},
        {"n_prelude_layers": 1, "n_coda_layers": 1},
        {"gated_recurrence": True, "inter_loop_norm": False},
        {"per_loop_norm": True, "n_kv_heads": 2},
    ],
)
def test_iter_loops_matches_forward(overrides):
    m = LoopLM(preset("debug-tiny", vocab_size=64, n_layers=1, **overrides)).eval()
    ids = torch.randint(0, 64, (2, 9))
    steps = list(iter_loops(m, ids, 3))
    with torch.no_grad():
        for t in (1, 2, 3):
            out = m(ids, n_loops=t)
            torch.testing.assert_close(steps[t - 1].exit_readout, out.readouts[-1])
            torch.testing.assert_close(steps[t - 1].state, out.states[-1])
            torch.testing.assert_close(torch.stack([s.gate_logit for s in steps[:t]]), out.gate_logits)


def test_exit_rules_on_crafted_trajectories():
    inf = math.inf
    # hidden-state change per loop for 4 tokens, T = 4 (loop 1 has no previous state)
    hd = torch.tensor(
        [[inf, inf, inf, inf], [0.5, 0.01, 0.5, 0.2], [0.05, 0.3, 0.5, 0.01], [0.0, 0.0, 0.5, 0.0]]
    ).float()
    assert hidden_diff_exit(hd, 0.1).tolist() == [3, 2, 4, 3]
    assert hidden_diff_exit(hd, 0.0).tolist() == [4, 4, 4, 4]  # strict <: never fires, run to T
    # ASH: ||Δp||_1 below eps for m consecutive loops
    ash = torch.tensor([[inf, inf, inf], [0.01, 0.5, 0.01], [0.01, 0.01, 0.5], [0.5, 0.01, 0.01]]).float()
    assert ash_exit(ash, 0.1, 1).tolist() == [2, 3, 2]
    assert ash_exit(ash, 0.1, 2).tolist() == [3, 4, 4]  # token 2's run restarts at loop 4: never 2 in a row
    assert below_for(ash, 0.1, 3).tolist() == [4, 4, 4]
    margin = torch.tensor([[0.1, 0.9], [0.6, 0.95], [0.7, 0.99]])
    assert margin_exit(margin, 0.5).tolist() == [2, 1]
    assert margin_exit(margin, 0.0).tolist() == [1, 1]
    assert margin_exit(margin, 1.0).tolist() == [3, 3]


def test_q_exit_zero_and_one_give_first_and_last_loop():
    gates = torch.randn(5, 100) * 3
    assert q_exit(gates, 0.0).tolist() == [1] * 100
    assert q_exit(gates, 1.0).tolist() == [5] * 100
    saturated = torch.full((5, 3), 40.0)  # λ ≈ 1: 1 - S_1 rounds to 1.0 in fp32, yet q = 1 still means "run to T"
    assert q_exit(saturated, 1.0).tolist() == [5] * 3
    assert q_exit(saturated, 0.999).tolist() == [1] * 3


def test_pareto_front():
    pts = [
        {"avg_loops": 1, "loss": 3.0},
        {"avg_loops": 2, "loss": 2.0},
        {"avg_loops": 2.5, "loss": 2.5},
        {"avg_loops": 3, "loss": 1.0},
        {"avg_loops": 1.5, "loss": 3.5},
    ]
    assert pareto_front(pts, "loss", higher_is_better=False) == [0, 1, 3]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"loops": [0, 2]}, "loops=0 is invalid"),
        ({"loops": [1, -3]}, "loops=-3 is invalid"),
        ({"q_thresholds": [0.5, 1.5]}, "q_thresholds=1.5 is invalid"),
        ({"margin_thresholds": [-0.1]}, "margin_thresholds=-0.1 is invalid"),
        ({"ash_eps": [3.0]}, "ash_eps=3.0 is invalid"),
    ],
)
def test_bad_config_one_line_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match) as e:
        evaluate(crafted_model(), counting_data(), EvalConfig(**kwargs))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "data,match",
    [
        ([], "dataset is empty"),
        ([[3]], "at least 2 tokens"),
        ({"input_ids": torch.zeros(1, 4, dtype=torch.long), "labels": torch.full((1, 4), -100)}, "dataset is empty"),
        ([[1, 2, 99]], "token id"),
    ],
)
def test_bad_dataset_one_line_errors(data, match):
    with pytest.raises(ConfigError, match=match) as e:
        depth_sweep(crafted_model(), data, loops=[1])
    assert "\n" not in str(e.value)


def test_not_a_looplm_model():
    with pytest.raises(ConfigError, match="expected a titanloop LoopLM"):
        exit_frontier(torch.nn.Linear(2, 2), counting_data())
