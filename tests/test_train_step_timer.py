"""Step-time breakdown and stragglers (titanloop.train.step_timer).

- 2 CPU ranks through the real trainer with one rank slowed on purpose (tests/slowed_rank_driver.py, a test-only
  launcher): the slowed rank is named on every log step, the other rank's wait covers the slowdown, the one-line
  straggler warning appears, and the measured phases sum to the measured step time within 10%;
- the CUDA-only part (a device synchronize at each phase end) and the barrier/all-gather with fakes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from titanloop.train.step_timer import PHASES, StepTimer, breakdown_line, breakdown_scalars, straggler_warning

from launch import REPO, train


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_phases_barriers_and_cuda_synchronize_with_fakes():
    clock, calls = FakeClock(), []

    def sync():
        calls.append("sync")

    def barrier():
        calls.append("barrier")
        clock.now += 0.5  # waiting for the other rank

    gathered = []

    def all_gather(x):
        gathered.append(x)
        return [x.tolist(), [2.0, 2.0, *[0.0] * len(PHASES)]]

    timer = StepTimer(True, "cuda", synchronize=sync, barrier=barrier, all_gather=all_gather, clock=clock)
    with timer.phase("forward"):
        clock.now += 1.0
    with timer.phase("backward"):
        clock.now += 2.0
    assert calls == ["sync", "barrier", "sync"] * 2  # CUDA: device work is counted before the barrier
    assert timer.times["forward"] == 1.0 and timer.times["backward"] == 2.0 and timer.times["wait"] == 1.0
    out = timer.finish(4.0)
    assert out["rank_busy"] == [3.0, 2.0] and out["rank_step"] == [4.0, 2.0]
    s = breakdown_scalars(out)
    assert s["time/slowest_rank"] == 0 and s["time/median_busy_s"] == 2.0 and s["time/slowest_vs_median"] == 1.5
    assert "slowest rank 0" in breakdown_line(7, s)
    assert "rank 0" in straggler_warning(7, s, 1.4) and straggler_warning(7, s, 1.6) is None
    assert straggler_warning(7, s, 0) is None

    cpu_calls = []
    cpu = StepTimer(True, "cpu", barrier=lambda: cpu_calls.append("barrier"), all_gather=lambda x: [x.tolist()])
    with cpu.phase("data"):
        pass
    assert cpu_calls == ["barrier"]  # no device synchronize off CUDA

    idle = StepTimer(False, "cuda", synchronize=sync, barrier=barrier, all_gather=all_gather, clock=clock)
    calls.clear()
    with idle.phase("forward"):
        pass
    assert calls == [] and idle.finish(1.0) == {} and breakdown_scalars({}) == {}


def run_slowed(run_dir: Path, slow_rank: int, seconds: float) -> tuple[list[dict], str]:
    """The trainer through tests/slowed_rank_driver.py (the trainer's arguments), rank `slow_rank` slowed."""
    run = train(
        run_dir,
        {"training.steps": 5, "metrics.log_freq": 1, "metrics.wandb": "off", "metrics.straggler_warn": 1.5},
        entry=[str(REPO / "tests" / "slowed_rank_driver.py")],
        env={"SLOW_RANK": str(slow_rank), "SLOW_SECONDS": str(seconds)},
    )
    return run.rows, run.stdout


@pytest.mark.slow
@pytest.mark.parametrize("slow_rank", [0, 1])
def test_a_slowed_rank_is_named_and_the_breakdown_adds_up(tmp_path, slow_rank):
    per_loop = 0.2  # seconds per loop, 4 loops per forward
    rows, out = run_slowed(tmp_path / "run", slow_rank, per_loop)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    ratios = []
    for r in rows:
        assert r["time/slowest_rank"] == slow_rank, r
        assert r["time/slowest_busy_s"] >= 4 * per_loop
        if slow_rank == 1:  # rank 0 (which logs) waits at the forward barrier for the slowed rank
            assert r["time/wait_s"] >= 0.8 * 4 * per_loop, r
        else:
            assert r["time/forward_s"] >= 4 * per_loop, r
        phases = sum(r[f"time/{p}_s"] for p in PHASES)
        ratios.append(phases / r["time/step_s"])
    print(
        f"slowed rank {slow_rank}: breakdown sum / step time per step {[round(x, 3) for x in ratios]}; "
        f"slowest/median {[round(r['time/slowest_vs_median'], 2) for r in rows]}"
    )
    assert all(0.9 <= x <= 1.0 for x in ratios), ratios
    warnings = [line for line in out.splitlines() if "warning: straggler" in line]
    # steps 2..5 (at step 1 both ranks are slow: first calls, lazy initialization); every warning names the rank
    assert {f"at step {s}:" for s in range(2, 6)} <= {w.split("straggler ")[1][:10] for w in warnings}, out[-2000:]
    assert all(f"rank {slow_rank} busy" in w for w in warnings), out[-2000:]
    assert sum(line.startswith("time ") for line in out.splitlines()) == 5
