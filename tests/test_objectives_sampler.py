"""Random-loop samplers: the same T on every rank for a step, reproducible across steps and restarts."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from titanloop.config_errors import ConfigError
from titanloop.objectives import LoopSampler, LoopSamplerConfig
from titanloop.train.process_exit import exit_without_teardown

STEPS = 300
KINDS = [
    dict(kind="lognormal", mu=2.0, sigma=0.7, min_sampled=1, max_sampled=100),
    dict(kind="lognormal", mu=1.7, sigma=0.4, min_sampled=1, max_sampled=16),
    dict(kind="poisson", rate=4.0, min_sampled=1, max_sampled=8),
    dict(kind="uniform", min_sampled=2, max_sampled=6),
]


def _rank_worker(rank: int, world: int, init_file: str, out_file: str):
    torch.set_num_threads(1)
    # Each rank burns a different amount of global RNG state first: the sampler must not depend on it.
    torch.manual_seed(1000 + rank)
    torch.randn(17 * (rank + 1))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        rows = []
        for kw in KINDS:
            sampler = LoopSampler(LoopSamplerConfig(seed=11, **kw))
            steps = list(range(STEPS)) if rank == 0 else list(reversed(range(STEPS)))  # order must not matter
            by_step = {s: sampler(s) for s in steps}
            rows.append([by_step[s] for s in range(STEPS)])
        mine = torch.tensor(rows)
        gathered = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine)
        if rank == 0:
            torch.save(torch.stack(gathered), out_file)
    finally:
        dist.destroy_process_group()
    exit_without_teardown(0)  # gloo's native threads can abort the spawned process's teardown (SIGABRT)


@pytest.mark.slow
def test_sampled_t_is_identical_on_every_rank(tmp_path):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = tmp_path / "gathered.pt"
    mp.spawn(_rank_worker, args=(2, str(tmp_path / "pg_init"), str(out)), nprocs=2, join=True)
    gathered = torch.load(out, weights_only=True)  # [world, kinds, steps]
    assert gathered.shape == (2, len(KINDS), STEPS)
    assert torch.equal(gathered[0], gathered[1])
    for row in gathered[0]:
        assert len(set(row.tolist())) > 2  # really sampled, not a constant
    local = torch.tensor([[LoopSampler(LoopSamplerConfig(seed=11, **kw))(s) for s in range(STEPS)] for kw in KINDS])
    assert torch.equal(gathered[0], local)  # and what a fresh process in this one draws


def test_same_seed_and_step_give_the_same_t_regardless_of_history():
    a = LoopSampler(LoopSamplerConfig(kind="lognormal", seed=3))
    b = LoopSampler(LoopSamplerConfig(kind="lognormal", seed=3))
    seq_a = [a(s) for s in range(200)]
    for _ in range(7):
        b(123)  # a resumed run has drawn other steps before
    assert [b(s) for s in range(200)] == seq_a
    assert len(set(seq_a)) > 3  # varies across steps
    c = LoopSampler(LoopSamplerConfig(kind="lognormal", seed=4))
    assert [c(s) for s in range(200)] != seq_a  # the seed matters


@pytest.mark.parametrize("kw", KINDS)
def test_samples_stay_in_the_clip_range(kw):
    sampler = LoopSampler(LoopSamplerConfig(seed=0, **kw))
    draws = [sampler(s) for s in range(2000)]
    assert min(draws) >= kw["min_sampled"] and max(draws) <= kw["max_sampled"]
    assert sampler.max_possible() == kw["max_sampled"]
    if kw["kind"] == "uniform":
        assert set(draws) == set(range(kw["min_sampled"], kw["max_sampled"] + 1))
    if kw["kind"] == "poisson":
        assert max(draws) == kw["max_sampled"]  # Poisson(4) exceeds 8 often enough to be clipped


def test_lognormal_median_matches_exp_mu():
    sampler = LoopSampler(LoopSamplerConfig(kind="lognormal", mu=2.0, sigma=0.7, max_sampled=100, seed=1))
    draws = torch.tensor([sampler(s) for s in range(3000)], dtype=torch.float32)
    assert 6.5 <= draws.median().item() <= 8.5  # median of round(exp(N(2, 0.7))) is round(e^2) = 7


def test_fixed_sampler_returns_n_loops():
    sampler = LoopSampler(LoopSamplerConfig(kind="fixed", n_loops=5))
    assert {sampler(s) for s in range(50)} == {5} and sampler.max_possible() == 5


@pytest.mark.parametrize(
    "field,kwargs",
    [
        ("loop_sampler.min_sampled", dict(kind="uniform", min_sampled=8, max_sampled=4)),
        ("loop_sampler.min_sampled", dict(min_sampled=0)),
        ("loop_sampler.kind", dict(kind="gaussian")),
        ("loop_sampler.n_loops", dict(n_loops=0)),
        ("loop_sampler.sigma", dict(kind="lognormal", sigma=0.0)),
        ("loop_sampler.rate", dict(kind="poisson", rate=-1.0)),
    ],
)
def test_bad_sampler_config_is_one_line_naming_the_field(field, kwargs):
    with pytest.raises(ConfigError) as e:
        LoopSamplerConfig(**kwargs)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(field + "=") and "expected" in msg
