"""Depth tools of the trainer (docs/training.md, "Depth that holds"): the Poisson-lognormal loop sampler and its
depth curriculum, truncated backpropagation through depth (`loop_sampler.backprop_loops`), the random initial state
and the diagonal (stable) injection.

- The sampler: Huginn's parametrization (E[rate] = mean, T = Poisson(rate) + 1) with its long tail; the curriculum
  ramps the mean; both a function of (seed, step) only.
- Truncation against a float64 reference: the gradients with the first T - k loops under no_grad equal those of the
  full graph with loop T - k's output detached, differ from full backpropagation's, and reach the per-loop norms
  of the last k loops only.
- FLOPs: LoopLMConfig.flops_per_token(backward_loops=k) equals torch's FLOP counter on a truncated step (forward of
  T loops, backward of k; with unread_loops=1, also the fixed-point penalty's loop T + 1), and the trainer's
  TFLOP/s use it; the memory plan of T = 8 truncated to k = 2 holds the activations of about two loops, not eight.
- Through `torchrun -m titanloop.train`: a run with every tool on, interrupted (SIGUSR1) and resumed, draws the same
  depths and ends bit for bit where the uninterrupted run does; the per-loop statistics cover the k loops with a
  graph; a truncation that would leave the embedding untrained is refused in one line.
- The Ouro exporter refuses the diagonal injection and the random initial state in one line, or writes them under
  the titanloop variant type, which loads back with the same outputs.
"""

from __future__ import annotations

import signal
import statistics
import time
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from titanloop.config_errors import ConfigError
from titanloop.model import LoopLM, LoopLMConfig
from titanloop.objectives import LoopSampler, LoopSamplerConfig, ObjectiveConfig, loop_objective
from titanloop.train.config import load_config

from helpers import assert_bitwise_same_run, logged_step
from launch import DEBUG, SMALL_BATCH, start, train

# ----- the sampler ---------------------------------------------------------------------------------------------


def test_poisson_lognormal_has_huginns_mean_and_a_long_tail():
    cfg = LoopSamplerConfig(kind="poisson_lognormal", mean=8.0, sigma=0.5, max_sampled=1000, seed=3)
    draws = [LoopSampler(cfg)(s) for s in range(1, 4001)]
    # E[T] = E[rate] + 1 = mean + 1 (a median-centred lognormal, mu = ln(mean), would give ~ 8 * e^{-1/8} + 1 + ...)
    assert statistics.mean(draws) == pytest.approx(9.0, abs=0.3)
    # the tail: P(T > 2 mean + 1) is ~5% with sigma = 0.5, ~0.4% for Poisson(8) + 1 alone
    assert sum(t > 17 for t in draws) / len(draws) > 0.03
    assert min(draws) >= 1
    clamped = LoopSamplerConfig(kind="poisson_lognormal", mean=8.0, sigma=0.5, min_sampled=2, max_sampled=12, seed=3)
    assert {LoopSampler(clamped)(s) for s in range(1, 2001)} <= set(range(2, 13))
    assert max(LoopSampler(clamped)(s) for s in range(1, 2001)) == 12


def test_the_curriculum_ramps_the_mean_over_its_fraction_of_training():
    cfg = LoopSamplerConfig(
        kind="poisson_lognormal", mean=16.0, mean_start=2.0, mean_ramp_fraction=0.5, max_sampled=1000, seed=1
    )
    sampler = LoopSampler(cfg, steps=4000)
    assert sampler.mean_at(1) == 2.0 and sampler.mean_at(1001) == pytest.approx(9.0)
    assert sampler.mean_at(2001) == sampler.mean_at(4000) == 16.0
    early = statistics.mean(sampler(s) for s in range(1, 201))
    late = statistics.mean(sampler(s) for s in range(2001, 4001))
    assert early < 4.5 and late == pytest.approx(17.0, abs=0.6)
    with pytest.raises(ConfigError, match=r"^loop_sampler\.mean_start=2\.0 .*poisson_lognormal"):
        LoopSamplerConfig(kind="lognormal", mean_start=2.0, mean_ramp_fraction=0.5)
    with pytest.raises(ConfigError, match=r"^loop_sampler\.mean_ramp_fraction=0\.0 "):
        LoopSamplerConfig(kind="poisson_lognormal", mean_start=2.0)


# ----- truncation against a float64 reference ----------------------------------------------------------------
T, K = 6, 2


def _model(**kw) -> LoopLM:
    torch.manual_seed(0)
    cfg = LoopLMConfig(
        vocab_size=97, hidden_size=32, n_heads=4, ffn_hidden_size=64, n_layers=2, n_loops=T, max_loops=T, **kw
    )
    return LoopLM(cfg).double()


def _batch():
    g = torch.Generator().manual_seed(5)
    return torch.randint(0, 97, (2, 12), generator=g), torch.randint(0, 97, (2, 12), generator=g)


def _grads(model: LoopLM, out, labels, objective: str) -> dict[str, torch.Tensor]:
    model.zero_grad()
    loss, _ = loop_objective(
        ObjectiveConfig(name=objective, ce_backward="recompute"),
        out.readouts,
        out.states,
        out.gate_logits,
        labels,
        model.lm_head.weight,
    )
    loss.backward()
    return {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}


def _reference(model: LoopLM, ids: torch.Tensor, detach_after: int | None):
    """The loop written out with a full graph; the input of loop `detach_after` + 1 detached (None: never); the
    output keeps the loops after it, as the truncated forward does."""
    cos, sin, mask = model.rope_and_mask(ids)
    e = model.embed(ids, cos, sin, mask)
    x = model.inject(model.initial_state(e), e) if model.cfg.init_state == "random" else e
    readouts, states, gates = [], [], []
    for t in range(T):
        h = model.loop_step(x, t, cos, sin, mask)
        normed = model.norm(h)
        if detach_after is None or t >= detach_after:
            readouts.append(normed)
            states.append(h)
            gates.append(model.early_exit_gate(normed).squeeze(-1))
        x = model.inject(model.next_loop_input(h, normed), e)
        if detach_after is not None and t == detach_after - 1:
            x = x.detach()
    return type("Out", (), {"readouts": readouts, "states": states, "gate_logits": torch.stack(gates)})


@pytest.mark.parametrize("objective", ["stage1", "dense", "final_only"])
@pytest.mark.parametrize(
    "variant",
    [dict(), dict(injection="diagonal", init_state="random")],
    ids=["add", "diagonal+random"],
)
def test_truncation_matches_a_detached_float64_reference(objective, variant):
    model = _model(inject_embedding=True, per_loop_norm=True, **variant)
    ids, labels = _batch()
    truncated = model(ids, T, backprop_loops=K)
    assert len(truncated.readouts) == K and truncated.gate_logits.shape[0] == K
    got = _grads(model, truncated, labels, objective)
    ref = _grads(model, _reference(model, ids, T - K), labels, objective)
    full = _grads(model, model(ids, T), labels, objective)
    for name in got:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-12, atol=1e-14, msg=name)
    # the loops it should: the per-loop norms of the first T - K loops get no gradient, the last K do
    for t in range(T):
        g_trunc, g_full = got[f"loop_norms.{t}.weight"], full[f"loop_norms.{t}.weight"]
        assert g_full.abs().max() > 1e-6
        if t < T - K:
            assert g_trunc.abs().max() == 0, t
        else:
            assert g_trunc.abs().max() > 1e-6, t
    # and the shared weights' gradients differ from full backpropagation through depth
    shared = "layers.0.mlp.up_proj.weight"
    assert (got[shared] - full[shared]).norm() > 1e-3 * full[shared].norm()
    # k >= T is full backpropagation, bit for bit
    again = _grads(model, model(ids, T, backprop_loops=T), labels, objective)
    assert all(torch.equal(again[n], full[n]) for n in full)


# ----- FLOPs and the memory plan count what runs ------------------------------------------------------------------


@pytest.mark.parametrize(
    "variant, unread",
    [
        (dict(), 0),
        (dict(n_prelude_layers=1, n_coda_layers=1, gated_recurrence=True), 0),
        (dict(gated_recurrence=True), 1),  # the fixed-point penalty's loop T + 1 (objective.fixed_point_weight)
    ],
)
def test_truncated_flops_match_the_flop_counter(variant, unread):
    cfg = LoopLMConfig(
        vocab_size=256, hidden_size=64, n_heads=4, ffn_hidden_size=160, n_layers=2, n_loops=T, max_seq_len=64,
        inject_embedding=True, **variant,
    )  # fmt: skip
    b, s = 2, 24
    torch.manual_seed(0)
    model = LoopLM(cfg)
    x = torch.randint(0, cfg.vocab_size, (b, s), generator=torch.Generator().manual_seed(1))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        out = model(x, T, backprop_loops=K, return_logits="all", loop_change=bool(unread))
        loss = out.logits.float().pow(2).mean() + out.gate_logits.pow(2).mean()
        (loss + (out.loop_change.pow(2).mean() if unread else 0)).backward()
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    attention = counts.pop("aten.bmm") * (s + 1) / (2 * s)  # causal: the attended share of the math kernel's square
    measured = attention + sum(counts.values())
    ours = cfg.flops_per_token(s, n_loops=T, backward_loops=K, unread_loops=unread) * b * s
    assert ours == pytest.approx(measured, rel=1e-9)
    if unread:  # without the extra loop: off by a loop's forward and backward
        assert cfg.flops_per_token(s, n_loops=T, backward_loops=K) * b * s < 0.9 * measured
    else:  # what a count of the backward of all T loops (the untruncated formula) would say: far off
        assert cfg.flops_per_token(s, n_loops=T) * b * s > 1.5 * measured
    assert cfg.flops_per_token(s, n_loops=T, backward_loops=T) == cfg.flops_per_token(s, n_loops=T)


def test_the_trainers_tflops_count_the_truncated_backward(tmp_path):
    overrides = ["--training.run_dir", str(tmp_path), "--metrics.wandb", "off", "--model.inject_embedding", "true"]
    overrides += ["--loop_sampler.n_loops", "8", "--loop_sampler.backprop_loops", "2"]
    cfg = load_config(DEBUG, overrides, world_size=1)
    per_loop = {"ce": [1.0] * 2, "exit_prob": [0.5] * 2, "hidden_rms": [1.0] * 2, "gate_entropy": [1.0]}
    row = logged_step(cfg, 8, per_loop)
    m = cfg.looplm
    assert row["tflops"] == pytest.approx(m.flops_per_token(64, 8, backward_loops=2) * 16 * 64 / 0.5 / 1e12)
    assert row["tflops"] < 0.6 * m.flops_per_token(64, 8) * 16 * 64 / 0.5 / 1e12


def _activations(*overrides: str) -> float:
    from titanloop.train.dry_run import dry_run

    cfg = load_config(DEBUG, ["--model.inject_embedding", "true", *overrides], world_size=1)
    return dry_run(cfg, 1, memory_plan=True).memory_plan.rows["activations"]


def test_the_memory_plan_holds_the_activations_of_the_loops_with_a_graph():
    full8 = _activations("--loop_sampler.n_loops", "8")
    full2 = _activations("--loop_sampler.n_loops", "2")
    truncated = _activations("--loop_sampler.n_loops", "8", "--loop_sampler.backprop_loops", "2")
    assert full8 > 3 * full2  # the plan sees loops at all
    assert truncated < 1.25 * full2, (truncated, full2, full8)
    assert truncated < 0.4 * full8, (truncated, full2, full8)


# ----- through the real entry point ------------------------------------------------------------------------------
TOOLS = {
    **SMALL_BATCH,
    "metrics.log_freq": 1,
    "loop_sampler.kind": "poisson_lognormal",
    "loop_sampler.mean": 6.0,
    "loop_sampler.sigma": 0.5,
    "loop_sampler.max_sampled": 16,
    "loop_sampler.mean_start": 2.0,
    "loop_sampler.mean_ramp_fraction": 0.5,
    "loop_sampler.backprop_loops": 2,
    "model.inject_embedding": True,
    "model.injection": "diagonal",
    "model.init_state": "random",
    "checkpoint.enable": True,
    "checkpoint.interval": 2,
    "checkpoint.mode": "sync",
    "training.steps": 8,
}


@pytest.fixture(scope="module")
def depth_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("depth")
    ref = train(root / "ref", TOOLS)
    chain = root / "chain"
    job = start(chain, TOOLS, nproc=2, log=root / "chain.1.log")
    job.wait_for_step(3)
    job.interrupt(signal.SIGUSR1, job.rank_pid(1))
    assert job.finish() != 0 and "preempted at step" in job.out, job.out[-3000:]
    stopped = int(job.out.split("preempted at step ")[1].split()[0])
    resumed = start(chain, TOOLS, nproc=2, log=root / f"chain.{time.monotonic_ns()}.log")
    assert resumed.finish() == 0, resumed.out[-3000:]
    return {"ref": ref, "chain": chain, "stopped": stopped}


@pytest.mark.slow
def test_a_resumed_run_draws_the_same_depths_and_ends_bit_for_bit_equal(depth_runs):
    ref = depth_runs["ref"]
    assert 3 <= depth_runs["stopped"] < 8
    sampler = LoopSampler(LoopSamplerConfig(**{k.split(".")[1]: v for k, v in TOOLS.items() if "loop_sampler" in k}), 8)
    depths = [ref.by_step[s]["n_loops"] for s in range(1, 9)]
    assert depths == [sampler(s) for s in range(1, 9)]
    assert len(set(depths)) > 2 and max(depths) > 2  # sampled, and some steps truncated
    assert_bitwise_same_run(depth_runs["chain"], ref.run_dir, 8)


@pytest.mark.slow
def test_the_statistics_cover_the_loops_with_a_graph(depth_runs):
    assert "loops poisson_lognormal, backprop through the last 2" in depth_runs["ref"].out
    for step, row in depth_runs["ref"].by_step.items():
        assert len(row["ce"]) == min(2, row["n_loops"]), (step, row["n_loops"], row["ce"])


@pytest.mark.slow
def test_a_truncation_that_leaves_the_embedding_untrained_is_refused(tmp_path):
    bad = train(tmp_path / "bad", {"loop_sampler.backprop_loops": 2, "training.steps": 1}, nproc=1, check=False)
    assert bad.returncode != 0
    lines = [line for line in bad.stderr.splitlines() if "loop_sampler.backprop_loops=2" in line]
    assert lines and "model.inject_embedding = true" in lines[0], bad.stderr


# ----- export ------------------------------------------------------------------------------------------------------


def test_the_ouro_exporter_refuses_or_writes_the_variant(tmp_path):
    from titanloop.interchange.ouro_hf import export_ouro_hf, import_ouro_hf

    torch.manual_seed(0)
    model = LoopLM(
        LoopLMConfig(
            vocab_size=97, hidden_size=32, n_heads=4, ffn_hidden_size=64, n_layers=2, n_loops=3,
            inject_embedding=True, injection="diagonal", init_state="random",
        )
    ).eval()  # fmt: skip
    with torch.no_grad():
        model.injection.A_log.uniform_(-1, 1)  # not the init values: the round trip must carry them
    with pytest.raises(ConfigError) as e:
        export_ouro_hf(model, tmp_path / "ouro")
    assert "\n" not in str(e.value) and "inject_embedding=true" in str(e.value)
    out = export_ouro_hf(model, tmp_path / "variant", allow_variant=True)
    back = import_ouro_hf(out).eval()
    assert back.cfg.injection == "diagonal" and back.cfg.init_state == "random"
    ids = torch.randint(0, 97, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(
            back(ids, 5, return_logits="last").logits, model(ids, 5, return_logits="last").logits
        )
    from titanloop.interchange.ouro_hf import ouro_incompatibilities

    why = ouro_incompatibilities(model.cfg)
    assert any(w.startswith("injection='diagonal'") for w in why)
    assert any(w.startswith("init_state='random'") for w in why)


def test_the_diagonal_injection_stays_contractive_whatever_its_parameters():
    model = _model(inject_embedding=True, injection="diagonal")
    with torch.no_grad():
        model.injection.A_log.copy_(torch.linspace(-6, 6, 32))
        model.injection.dt.copy_(torch.linspace(6, -6, 32))
    a = model.injection.decay()
    assert a.max() < 1 and a.min() >= 0
    assert torch.allclose(_model(inject_embedding=True, injection="diagonal").injection.decay(), torch.tensor(0.9))


def test_the_random_initial_state_decodes_the_same_with_and_without_a_kv_cache():
    """Evaluation draws one state per position (seed 0): a cached decode equals the full forward, and a sequence's
    logits do not depend on its batch-mates."""
    from titanloop.eval.generate import LoopKVCache
    from titanloop.eval.trace import iter_loops
    from titanloop.model import preset

    torch.manual_seed(0)
    m = LoopLM(preset("debug-tiny", vocab_size=96, inject_embedding=True, injection="diagonal", init_state="random"))
    m.eval()
    ids = torch.randint(0, 96, (3, 7), generator=torch.Generator().manual_seed(3))
    cache = LoopKVCache(4, "full")
    with torch.no_grad():
        steps = list(iter_loops(m, ids, 4, kv_cache=cache))
        cache.start_decoding()
        nxt = m.lm_head(steps[-1].exit_readout[:, -1]).argmax(-1, keepdim=True)
        for _ in range(3):
            step = list(iter_loops(m, nxt, 4, kv_cache=cache, position_offset=ids.shape[1]))[-1]
            cache.commit(torch.full((3,), 4))
            ids = torch.cat([ids, nxt], 1)
            ref = m(ids, return_logits="last").logits[:, -1]
            torch.testing.assert_close(m.lm_head(step.exit_readout[:, -1]), ref, atol=1e-5, rtol=1e-5)
            nxt = ref.argmax(-1, keepdim=True)
        alone = m(ids[1:2], return_logits="last").logits
        torch.testing.assert_close(alone, m(ids, return_logits="last").logits[1:2], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "overrides, world, match",
    [
        (
            ["--objective.name", "stage2_gate", "--loop_sampler.backprop_loops", "1"],
            1,
            r"loop_sampler\.backprop_loops=1 ",
        ),
        (["--parallelism.tp", "2", "--model.injection", "diagonal"], 2, r"model\.injection='diagonal' .*tensor paral"),
        (["--parallelism.tp", "2", "--model.init_state", "random"], 2, r"model\.init_state='random' .*tensor paral"),
        (["--model.inject_embedding", "false", "--model.init_state", "random"], 1, r"init_state='random' .*inject_emb"),
        (
            ["--model.inject_embedding", "false", "--model.injection", "diagonal"],
            1,
            r"injection='diagonal' .*inject_emb",
        ),
    ],
)
def test_what_the_depth_tools_cannot_run_with_is_refused_in_one_line(overrides, world, match):
    with pytest.raises(ConfigError, match=match) as e:
        load_config(DEBUG, ["--model.inject_embedding", "true", *overrides], world_size=world)
    assert "\n" not in str(e.value)
