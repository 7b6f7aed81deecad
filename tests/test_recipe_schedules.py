"""Stage schedules: WSD shapes of every Ouro stage, exact resume, refusing a changed schedule, batch ramps."""

import math

import pytest
import torch

from titanloop.config_errors import ConfigError
from titanloop.recipe.schedules import BatchRamp, StagedLRSchedulers, lr_factor


def _build(total=100, **kw):
    p = torch.zeros(2, requires_grad=True)
    opt = torch.optim.AdamW([p], lr=3e-4)
    cfg = StagedLRSchedulers.Config(total_steps=total, **kw)
    return opt, cfg.build(optimizers=[opt], training_steps=total)


def _lrs(opt, sched, n):
    out = []
    for _ in range(n):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_warmup_then_constant_stage1a():
    f = [
        lr_factor(s, warmup_steps=10, total_steps=100, decay_ratio=0.0, decay_type="linear", min_lr_factor=0.0)
        for s in range(100)
    ]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert all(x == 1.0 for x in f[10:])


def test_cosine_decay_to_floor_stage2():
    kw = dict(warmup_steps=0, total_steps=100, decay_ratio=1.0, decay_type="cosine", min_lr_factor=0.1)
    f = [lr_factor(s, **kw) for s in range(101)]
    assert f[0] == pytest.approx(1.0, abs=1e-3)
    assert f[100] == pytest.approx(0.1)  # 3e-4 * 0.1 = 3e-5 at the end of the stage
    assert all(a >= b for a, b in zip(f, f[1:]))
    mid = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 50 / 100))  # one stable step, then progress s/100
    assert f[50] == pytest.approx(mid)


@pytest.mark.parametrize("decay_type", ["linear", "sqrt", "cosine"])
def test_wsd_shapes(decay_type):
    kw = dict(warmup_steps=5, total_steps=50, decay_ratio=0.2, decay_type=decay_type, min_lr_factor=0.05)
    f = [lr_factor(s, **kw) for s in range(51)]
    assert all(x == 1.0 for x in f[5:40])
    assert f[50] == pytest.approx(0.05)
    assert all(a >= b - 1e-12 for a, b in zip(f[5:], f[6:]))


def test_resume_mid_stage_gives_identical_lr_sequence():
    kw = dict(warmup_steps=5, decay_ratio=0.5, decay_type="cosine", min_lr_factor=0.1)
    opt, sched = _build(**kw)
    full = _lrs(opt, sched, 60)
    opt1, s1 = _build(**kw)
    first = _lrs(opt1, s1, 25)
    saved = s1.state_dict()
    opt2, s2 = _build(**kw)
    s2.load_state_dict(saved)
    second = _lrs(opt2, s2, 35)
    assert first + second == full


def test_changed_total_steps_refused_or_explicitly_allowed():
    opt, s = _build(total=100, warmup_steps=0, decay_ratio=1.0, decay_type="cosine")
    _lrs(opt, s, 10)
    saved = s.state_dict()
    _, s2 = _build(total=200, warmup_steps=0, decay_ratio=1.0, decay_type="cosine")
    with pytest.raises(ConfigError, match=r"total_steps: 100 -> 200"):
        s2.load_state_dict(saved)
    opt3, s3 = _build(total=200, warmup_steps=0, decay_ratio=1.0, decay_type="cosine", allow_schedule_change=True)
    s3.load_state_dict(saved)
    assert s3.schedulers[0].last_epoch == 10


def test_bad_schedule_values():
    with pytest.raises(ConfigError, match="lr_scheduler.decay_ratio"):
        _build(decay_ratio=1.5)
    with pytest.raises(ConfigError, match="lr_scheduler.min_lr_factor"):
        _build(min_lr_factor=-0.1)


def test_batch_ramp_stairs_and_bounds():
    # Ouro stage 1 at 4K sequences: 1024 -> 2048 sequences (4M -> 8M tokens) in stairs of 128
    ramp = BatchRamp(start=1024, end=2048, ramp_steps=1000, increment=128)
    assert ramp.batch_at(0) == 1024 and ramp.tokens_at(0, 4096) == 4 * 2**20
    assert ramp.batch_at(124) == 1024 and ramp.batch_at(125) == 1152
    assert ramp.batch_at(500) == 1536
    assert ramp.batch_at(999) == 1920 and ramp.batch_at(1000) == 2048 and ramp.batch_at(10**6) == 2048
    seq = [ramp.batch_at(s) for s in range(1200)]
    assert all(a <= b for a, b in zip(seq, seq[1:])) and all(b % 128 == 0 for b in seq)
    ramp.check_layout(micro_batch_size=2, dp_world=64)
    with pytest.raises(ConfigError, match="batch_ramp_increment"):
        ramp.check_layout(micro_batch_size=4, dp_world=64)
    # the error names a value that works: a multiple of micro_batch_size * dp dividing start and end
    with pytest.raises(ConfigError, match=r"e\.g\. batch_ramp_increment=256\)$"):
        ramp.check_layout(micro_batch_size=2, dp_world=128)
    with pytest.raises(ConfigError, match="no increment fits batch_ramp_start=1024 and global_batch_size=2048"):
        ramp.check_layout(micro_batch_size=2, dp_world=1024)
    with pytest.raises(ConfigError, match="batch_ramp_increment"):
        BatchRamp(start=1000, end=2048, ramp_steps=10, increment=128)
    with pytest.raises(ConfigError, match="global_batch_size"):
        BatchRamp(start=2048, end=1024, ramp_steps=10, increment=128)


def test_apply_lr_overrides_a_loaded_optimizer_lr():
    """A new stage that loads the previous stage's optimizer state (whose param groups carry the old stage's
    last LR) must train with its own schedule's LR."""
    opt, sched = _build(total=10, warmup_steps=0, decay_ratio=0.0, decay_type="linear")
    opt.param_groups[0]["lr"] = 6.95e-4  # what loading the previous stage's optimizer state leaves behind
    sched.apply_lr()
    assert opt.param_groups[0]["lr"] == pytest.approx(3e-4)
