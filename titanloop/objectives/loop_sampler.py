"""How many loops T a training step runs: fixed, or sampled per step (STARS §4.3.1, Huginn), and how many of them
backpropagate (truncated backpropagation through depth, Huginn / Parcae).

The sample depends only on (seed, step), never on the rank or on how many samples were drawn before, so
every rank draws the same T for a step (collectives would hang otherwise) and a resumed run draws the same
sequence as an uninterrupted one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from titanloop.config_errors import require, require_choice

SAMPLERS = ("fixed", "lognormal", "poisson", "uniform", "poisson_lognormal")


@dataclass
class LoopSamplerConfig:
    kind: str = "fixed"  # fixed | lognormal | poisson | uniform | poisson_lognormal
    n_loops: int = 4  # the fixed T; for a sampled T, the default depth of inference and validation
    mu: float = 2.0  # lognormal: T = round(exp(N(mu, sigma))), clipped to [min_sampled, max_sampled]
    sigma: float = 0.7  # lognormal and poisson_lognormal (Huginn: 0.5)
    rate: float = 4.0  # poisson: T = Poisson(rate), clipped
    # poisson_lognormal (Huginn's long tail): rate ~ LogNormal(ln(mean) - sigma^2/2, sigma), so E[rate] = mean;
    # T = Poisson(rate) + 1, clipped to [min_sampled, max_sampled]
    mean: float = 4.0
    # depth curriculum (poisson_lognormal): the mean ramps linearly from mean_start at step 1 to `mean` at
    # mean_ramp_fraction of training.steps, then stays; mean_start = 0: no curriculum
    mean_start: float = 0.0
    mean_ramp_fraction: float = 0.0
    # bounds of a sampled T (uniform: its range); not the model's max_loops (its number of per-loop norms)
    min_sampled: int = 1
    max_sampled: int = 100
    seed: int = 0
    # truncated backpropagation through depth: only the last `backprop_loops` loops of a step build a graph, the
    # first T - backprop_loops run under torch.no_grad(); the objective sees the loops with a graph only
    # (docs/training.md, "Depth that holds"). 0: every loop backpropagates (Ouro)
    backprop_loops: int = 0

    def __post_init__(self):
        require_choice(self.kind, "loop_sampler.kind", SAMPLERS)
        require(self.n_loops >= 1, "loop_sampler.n_loops", self.n_loops, "an integer >= 1")
        require(self.min_sampled >= 1, "loop_sampler.min_sampled", self.min_sampled, "an integer >= 1")
        require(
            self.min_sampled <= self.max_sampled,
            "loop_sampler.min_sampled",
            self.min_sampled,
            f"<= loop_sampler.max_sampled={self.max_sampled}",
        )
        require(self.sigma > 0, "loop_sampler.sigma", self.sigma, "a value > 0")
        require(self.rate > 0, "loop_sampler.rate", self.rate, "a value > 0")
        require(self.mean > 0, "loop_sampler.mean", self.mean, "a value > 0 (the mean rate of poisson_lognormal)")
        require(self.mean_start >= 0, "loop_sampler.mean_start", self.mean_start, "a value >= 0 (0: no curriculum)")
        require(
            self.mean_start == 0 or self.kind == "poisson_lognormal",
            "loop_sampler.mean_start",
            self.mean_start,
            "0 unless loop_sampler.kind = 'poisson_lognormal' (the curriculum ramps its mean)",
        )
        require(
            0 <= self.mean_ramp_fraction <= 1,
            "loop_sampler.mean_ramp_fraction",
            self.mean_ramp_fraction,
            "a fraction of training.steps in [0, 1]",
        )
        require(
            self.mean_start == 0 or self.mean_ramp_fraction > 0,
            "loop_sampler.mean_ramp_fraction",
            self.mean_ramp_fraction,
            "a value in (0, 1] when loop_sampler.mean_start is set (the part of training the mean ramps over)",
        )
        require(
            self.backprop_loops >= 0,
            "loop_sampler.backprop_loops",
            self.backprop_loops,
            "an integer >= 0 (the last loops that backpropagate; 0 = all)",
        )

    def bounds(self) -> tuple[int, int]:
        """The fewest and the most loops a step can run."""
        return (self.n_loops, self.n_loops) if self.kind == "fixed" else (self.min_sampled, self.max_sampled)

    def graph_loops(self, n_loops: int) -> int:
        """How many of a step's `n_loops` loops build a graph and backpropagate: the last backprop_loops, or all."""
        return n_loops if self.backprop_loops == 0 else min(n_loops, self.backprop_loops)

    @property
    def truncates(self) -> bool:
        """Whether some step may run loops without a graph (a step deeper than backprop_loops)."""
        return self.backprop_loops > 0 and self.bounds()[1] > self.backprop_loops


class LoopSampler:
    """T for a step: `sampler(step)`, a function of (seed, step) only. `steps` (training.steps) places the depth
    curriculum's ramp; a sampler without a curriculum ignores it."""

    def __init__(self, cfg: LoopSamplerConfig, steps: int | None = None):
        self.cfg = cfg
        self.steps = steps
        if cfg.mean_start > 0:
            require(
                steps is not None and steps >= 1,
                "training.steps",
                steps,
                "an integer >= 1 (the depth curriculum ramps over a fraction of it)",
            )

    def mean_at(self, step: int) -> float:
        """poisson_lognormal's mean rate at `step` (1-based, as the trainer counts): the curriculum's ramp from
        mean_start to mean over mean_ramp_fraction of training.steps, then mean."""
        c = self.cfg
        if c.mean_start <= 0:
            return c.mean
        ramp = c.mean_ramp_fraction * self.steps
        frac = 1.0 if ramp <= 0 else min(1.0, max(0, step - 1) / ramp)
        return c.mean_start + (c.mean - c.mean_start) * frac

    def _generator(self, step: int) -> torch.Generator:
        # splitmix-style mixing of (seed, step) into one 63-bit seed
        x = (self.cfg.seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) % (1 << 63)
        return torch.Generator().manual_seed(x)

    def __call__(self, step: int) -> int:
        c = self.cfg
        if c.kind == "fixed":
            return c.n_loops
        g = self._generator(step)
        if c.kind == "lognormal":
            z = torch.randn((), generator=g).item()
            t = int(round(math.exp(c.mu + c.sigma * z)))
        elif c.kind == "poisson":
            t = int(torch.poisson(torch.tensor(float(c.rate)), generator=g).item())
        elif c.kind == "poisson_lognormal":  # Huginn (recpre): E[rate] = mean, a long right tail in T
            mean = self.mean_at(step)
            z = torch.randn((), generator=g, dtype=torch.float64).item()
            rate = math.exp(math.log(mean) - c.sigma**2 / 2 + c.sigma * z)
            t = int(torch.poisson(torch.tensor(rate, dtype=torch.float64), generator=g).item()) + 1
        else:
            t = int(torch.randint(c.min_sampled, c.max_sampled + 1, (), generator=g).item())
        return max(c.min_sampled, min(c.max_sampled, t))

    def max_possible(self) -> int:
        return self.cfg.bounds()[1]
