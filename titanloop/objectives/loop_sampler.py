"""How many loops T a training step runs: fixed, or sampled per step (STARS §4.3.1, Huginn).

The sample depends only on (seed, step), never on the rank or on how many samples were drawn before, so
every rank draws the same T for a step (collectives would hang otherwise) and a resumed run draws the same
sequence as an uninterrupted one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from titanloop.config_errors import require, require_choice

SAMPLERS = ("fixed", "lognormal", "poisson", "uniform")


@dataclass
class LoopSamplerConfig:
    kind: str = "fixed"  # fixed | lognormal | poisson | uniform
    n_loops: int = 4  # the fixed T
    mu: float = 2.0  # lognormal: T = round(exp(N(mu, sigma))), clipped to [min_sampled, max_sampled]
    sigma: float = 0.7
    rate: float = 4.0  # poisson: T = Poisson(rate), clipped
    # bounds of a sampled T (uniform: its range); not the model's max_loops (its number of per-loop norms)
    min_sampled: int = 1
    max_sampled: int = 100
    seed: int = 0

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

    def bounds(self) -> tuple[int, int]:
        """The fewest and the most loops a step can run."""
        return (self.n_loops, self.n_loops) if self.kind == "fixed" else (self.min_sampled, self.max_sampled)


class LoopSampler:
    def __init__(self, cfg: LoopSamplerConfig):
        self.cfg = cfg

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
        else:
            t = int(torch.randint(c.min_sampled, c.max_sampled + 1, (), generator=g).item())
        return max(c.min_sampled, min(c.max_sampled, t))

    def max_possible(self) -> int:
        return self.cfg.bounds()[1]
