"""The loader follows a per-step global batch schedule (batch-size ramp) independently of the world size."""

from titanloop.data import DataConfig, build_dataloader
from titanloop.recipe.schedules import BatchRamp

RAMP = BatchRamp(start=4, end=16, ramp_steps=6, increment=4)


def _steps(dp_world: int, n_steps: int, state=None):
    """Global sample ids per optimizer step, gathered over all ranks (ranks simulated in one process)."""
    loaders = [
        build_dataloader(
            DataConfig(kind="synthetic_text", prefetch=0),
            seq_len=16,
            micro_batch_size=2,
            global_batch_size=RAMP.end,
            dp_rank=r,
            dp_world=dp_world,
            vocab_size=64,
            batch_schedule=RAMP.batch_at,
        )
        for r in range(dp_world)
    ]
    if state is not None:
        for ld in loaders:
            ld.load_state_dict(state)
    first = loaders[0].state_dict()["steps"]
    out = []
    for step in range(first, first + n_steps):
        ids = []
        for ld in loaders:
            for _ in range(ld.grad_accum_at(step)):
                ids += ld.__next__()["sample_ids"].tolist()
        out.append(sorted(ids))
    return out, loaders[0].state_dict()


def test_ramp_batches_grow_and_do_not_depend_on_world_size():
    one, _ = _steps(1, 8)
    two, _ = _steps(2, 8)
    assert [len(s) for s in one] == [RAMP.batch_at(s) for s in range(8)] == [4, 4, 8, 8, 12, 12, 16, 16]
    assert one == two
    flat = [i for s in one for i in s]
    assert flat == list(range(len(flat)))  # contiguous global sample sequence, nothing skipped or repeated


def test_resume_mid_ramp_on_another_world_size():
    full, _ = _steps(1, 8)
    head, state = _steps(2, 3)
    tail, _ = _steps(1, 5, state)
    assert head + tail == full
