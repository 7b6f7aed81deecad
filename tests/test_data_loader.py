"""Loader interface, global sample sequence and resume at another world size (simulated ranks)."""

import json
import time

import pytest
import torch

from titanloop.config_errors import ConfigError
from titanloop.data import DataConfig, build_dataloader

SEQ, MBS, GBS = 32, 2, 8


def make(cfg, rank, world, vocab=512, prefetch=None):
    if prefetch is not None:
        cfg = DataConfig.from_dict({**cfg.to_dict(), "prefetch": prefetch})
    return build_dataloader(
        cfg, seq_len=SEQ, micro_batch_size=MBS, global_batch_size=GBS, dp_rank=rank, dp_world=world, vocab_size=vocab
    )


def run_steps(cfg, world, steps, state=None):
    """Run `steps` optimizer steps on `world` simulated ranks; return {sample_id: input row}, final states."""
    grad_accum = GBS // (MBS * world)
    seen, states = {}, []
    for rank in range(world):
        loader = make(cfg, rank, world)
        if state is not None:
            loader.load_state_dict(json.loads(json.dumps(state)))
        for _ in range(steps * grad_accum):
            batch = next(loader)
            for sid, row in zip(batch["sample_ids"].tolist(), batch["input_ids"]):
                assert sid not in seen, f"sample {sid} delivered twice"
                seen[sid] = row
        states.append(loader.state_dict())
        loader.close()
    return seen, states


@pytest.mark.parametrize("kind", ["synthetic_text", "synthetic_task"])
def test_batch_shapes_labels_and_doc_ids(kind):
    loader = make(DataConfig(kind=kind, task="mano"), 0, 1)
    batch = next(loader)
    for key in ("input_ids", "labels", "doc_ids"):
        assert batch[key].shape == (MBS, SEQ) and batch[key].dtype == torch.long
    # labels are the next tokens wherever they are not ignored
    nxt = next(make(DataConfig(kind=kind, task="mano"), 0, 1))
    assert torch.equal(batch["input_ids"], nxt["input_ids"])  # deterministic
    keep = batch["labels"][:, :-1] != -100
    assert torch.equal(batch["labels"][:, :-1][keep], batch["input_ids"][:, 1:][keep])
    assert (batch["doc_ids"][:, 0] == 0).all() and (batch["doc_ids"].diff(dim=1) >= 0).all()
    assert int(batch["input_ids"].max()) < 512
    loader.close()


@pytest.mark.parametrize("resume_world", [1, 4])
@pytest.mark.parametrize("kind", ["synthetic_text", "synthetic_task"])
def test_resume_on_other_world_size_continues_global_sequence(kind, resume_world):
    cfg = DataConfig(kind=kind, task="addition", seed=3)
    full, _ = run_steps(cfg, world=2, steps=6)
    first, states = run_steps(cfg, world=2, steps=2)
    assert all(s == states[0] for s in states), "resume state must be identical on every rank"
    second, _ = run_steps(cfg, world=resume_world, steps=4, state=states[0])
    assert not set(first) & set(second)
    assert sorted(first) + sorted(second) == sorted(full) == list(range(6 * GBS))
    for sid, row in {**first, **second}.items():
        assert torch.equal(row, full[sid])


def test_prefetch_matches_synchronous_and_state_counts_steps():
    cfg = DataConfig(kind="synthetic_text")
    a, b = make(cfg, 0, 2, prefetch=0), make(cfg, 0, 2, prefetch=3)
    for _ in range(5):
        assert torch.equal(next(a)["input_ids"], next(b)["input_ids"])
    # grad_accum = 2: after 5 micro-batches, 2 optimizer steps are complete
    assert b.state_dict()["steps"] == 2 and b.state_dict()["global_samples"] == 2 * GBS
    a.close(), b.close()


def test_prefetch_error_reaches_the_consumer_and_close_does_not_wait():
    """A source error in the prefetch thread is raised by next(); and a loader closed while the thread holds an
    error for a full queue stops at once (the thread never blocks a stop)."""
    import threading

    failed = threading.Event()

    def breaking(source):
        row = source.row

        def wrapped(k, *a):
            if k >= 6:  # the fourth micro-batch (2 rows each) cannot be read
                failed.set()
                raise OSError(f"row {k}: disk read failed")
            return row(k, *a)

        return wrapped

    loader = make(DataConfig(kind="synthetic_text"), 0, 1, prefetch=2)
    loader.sources[0].row = breaking(loader.sources[0])
    next(loader)  # the thread then fills the queue (2 micro-batches) and fails on the next one
    assert failed.wait(60)
    time.sleep(0.3)  # the thread now waits to hand its error to a full queue
    closer = threading.Thread(target=loader.close, daemon=True)
    closer.start()
    closer.join(30)  # before the fix it waited for the 300 s join timeout
    assert not closer.is_alive(), "close() waited on a prefetch thread blocked on a full queue"

    loader = make(DataConfig(kind="synthetic_text"), 0, 1, prefetch=2)
    loader.sources[0].row = breaking(loader.sources[0])
    with pytest.raises(OSError, match="row 6: disk read failed"):
        for _ in range(10):
            next(loader)
    loader.close()


def test_bad_batch_geometry_and_state_are_one_line_errors():
    with pytest.raises(ConfigError, match="global_batch_size"):
        build_dataloader(
            DataConfig(), seq_len=8, micro_batch_size=3, global_batch_size=8, dp_rank=0, dp_world=2, vocab_size=64
        )
    with pytest.raises(ConfigError, match="data.kind"):
        DataConfig(kind="parquet")
    loader = make(DataConfig(seed=1), 0, 1)
    state = loader.state_dict()
    with pytest.raises(ConfigError, match="data.seed"):
        make(DataConfig(seed=2), 0, 1).load_state_dict(state)
    with pytest.raises(ConfigError, match="vocab_size"):
        make(DataConfig(kind="synthetic_task", task="multihop"), 0, 1, vocab=64)
