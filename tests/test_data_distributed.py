"""Real 2-process check (torchrun, gloo): disjoint per-rank streams, identical global state on every rank,
and resuming that state on 1 rank continues the uninterrupted global sequence."""

import argparse
import json
import os

import numpy as np
import pytest

from launch import run

SEQ, MBS, GBS, STEPS = 16, 2, 8, 5


def data_config(shards):
    from titanloop.data import DataConfig, SourceConfig

    return DataConfig(
        kind="webdataset",
        seed=11,
        shuffle_block=4,
        sources=[SourceConfig(os.path.join(shards, "a"), 3.0), SourceConfig(os.path.join(shards, "b"), 1.0)],
    )


def worker(shards: str, out: str) -> None:
    import torch.distributed as dist

    from titanloop.data import build_dataloader

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    loader = build_dataloader(
        data_config(shards),
        seq_len=SEQ,
        micro_batch_size=MBS,
        global_batch_size=GBS,
        dp_rank=rank,
        dp_world=world,
        vocab_size=512,
    )
    rows = {}
    for _ in range(STEPS * GBS // (MBS * world)):
        batch = next(loader)
        for sid, row in zip(batch["sample_ids"].tolist(), batch["input_ids"].tolist()):
            rows[sid] = row
    gathered = [None] * world
    dist.all_gather_object(gathered, {"rank": rank, "rows": rows, "state": loader.state_dict()})
    if rank == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)
    loader.close()
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_gloo_ranks_then_resume_on_one(tmp_path):
    from titanloop.data import build_dataloader
    from titanloop.data.shard_output import write_shard_set

    tok = {"fingerprint": "sha1:dist-test", "vocab_size": 512, "eos_id": 0}
    for name, seed in (("a", 1), ("b", 2)):
        rng = np.random.default_rng(seed)
        docs = ((np.append(rng.integers(1, 512, 40), 0), f"{name}{i}", 0, {}) for i in range(30))
        write_shard_set(str(tmp_path / name), "webdataset", name, docs, tok, shard_bytes=4000)
    out = tmp_path / "ranks.json"
    run(2, os.path.abspath(__file__), "--shards", str(tmp_path), "--out", str(out), timeout=300)
    ranks = json.loads(out.read_text())
    assert ranks[0]["state"] == ranks[1]["state"], "global state must be identical on every rank"
    ids0, ids1 = set(map(int, ranks[0]["rows"])), set(map(int, ranks[1]["rows"]))
    assert not ids0 & ids1 and ids0 | ids1 == set(range(STEPS * GBS))

    def single(state=None, steps=2 * STEPS):
        ld = build_dataloader(
            data_config(str(tmp_path)),
            seq_len=SEQ,
            micro_batch_size=MBS,
            global_batch_size=GBS,
            dp_rank=0,
            dp_world=1,
            vocab_size=512,
        )
        if state:
            ld.load_state_dict(state)
        rows = {}
        for _ in range(steps * GBS // MBS):
            b = next(ld)
            rows.update(zip(b["sample_ids"].tolist(), b["input_ids"].tolist()))
        ld.close()
        return rows

    full = single()
    resumed = single(ranks[0]["state"], STEPS)
    distributed = {int(k): v for r in ranks for k, v in r["rows"].items()}
    assert sorted(set(distributed) | set(resumed)) == sorted(full) and not set(distributed) & set(resumed)
    assert all(full[k] == v for k, v in {**distributed, **resumed}.items())


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--shards", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    worker(a.shards, a.out)
    from titanloop.train.process_exit import exit_without_teardown

    exit_without_teardown(0)  # gloo's native threads can abort the teardown (SIGABRT)
