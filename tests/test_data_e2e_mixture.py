"""End to end: FineWeb-style parquet and Nemotron-style jsonl.zst -> data_pipelines.tokenize -> an MDS and a
webdataset shard set -> `torchrun -m titanloop.train` on a 70/30 mixture of them on 2 ranks, preempted by
SIGUSR1, resumed on 1 rank -> every sample of every step trained exactly once, with the rows an uninterrupted
run reads (sample ids, sources, rows and token hashes from data.trace_samples)."""

from __future__ import annotations

import json
import signal
from collections import Counter
from pathlib import Path

import pytest

from data_pipelines import tokenize
from data_pipelines.sample_corpus import write_sample_corpus

from launch import start

pytestmark = pytest.mark.slow
STEPS, GBS, MBS, SEQ, VOCAB = 8, 16, 4, 32, 400

CONFIG = """
[model]
preset = "debug-tiny"
vocab_size = {vocab}
[objective]
name = "stage1"
[loop_sampler]
kind = "fixed"
n_loops = 2
[optimizer]
lr = 1e-3
[lr_scheduler]
warmup_steps = 2
[training]
run_dir = "{run_dir}"
steps = {steps}
seq_len = {seq}
micro_batch_size = {mbs}
global_batch_size = {gbs}
seed = 0
[parallelism]
dp_shard = -1
[data]
kind = "shards"
tokenizer = "{tokenizer}"
seed = 3
shuffle_block = 4
prefetch = 2
trace_samples = "{trace}"
[[data.sources]]
path = "{fineweb}"
weight = 70.0
[[data.sources]]
path = "{nemotron}"
weight = 30.0
[checkpoint]
enable = true
interval = 2
mode = "sync"
[metrics]
log_freq = 1
wandb = "off"
"""


def records(trace: Path) -> list[dict]:
    return [json.loads(ln) for p in sorted(trace.glob("rank-*.jsonl")) for ln in p.read_text().splitlines()]


@pytest.fixture(scope="module")
def shard_sets(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e-data")
    corpus = write_sample_corpus(str(root / "raw"), files=2, docs=60, vocab_size=VOCAB)
    for name, fmt in (("fineweb", "mds"), ("nemotron", "webdataset")):
        tokenize.main(
            [
                "--tokenizer",
                corpus["tokenizer"],
                "--out",
                str(root / name),
                "--format",
                fmt,
                "--workers",
                "1",
                "--shard-bytes",
                "6000",
                "--source",
                name,
                corpus[name],
            ]
        )
    return root, corpus["tokenizer"]


def test_mixture_trains_on_2_ranks_preempted_resumed_on_1(shard_sets, tmp_path):
    root, tokenizer = shard_sets
    run_dir, trace = tmp_path / "run", tmp_path / "trace"
    config = tmp_path / "mix.toml"
    config.write_text(
        CONFIG.format(
            vocab=VOCAB,
            run_dir=run_dir,
            steps=STEPS,
            seq=SEQ,
            mbs=MBS,
            gbs=GBS,
            tokenizer=tokenizer,
            trace=trace,
            fineweb=root / "fineweb",
            nemotron=root / "nemotron",
        )
    )

    # the run dir and the trace folder are the config's
    first = start(None, config=config, nproc=2, log=tmp_path / "launch-0.log")
    first.wait_until(lambda: trace.exists() and any(r["step"] >= 3 for r in records(trace)), "step 3", 240, 0.1)
    first.signal_workers(signal.SIGUSR1)
    assert first.finish(120) != 0
    log0 = first.out
    stop = int(
        next(ln for ln in log0.splitlines() if "preempted at step" in ln).split("preempted at step")[1].split()[0]
    )
    assert 1 <= stop < STEPS

    second = start(None, config=config, nproc=1, log=tmp_path / "launch-1.log")
    assert second.finish(300) == 0, second.out[-3000:]
    before = [r for r in records(trace) if r["world"] == 2]
    after = [r for r in records(trace) if r["world"] == 1]

    # Steps < stop come from the 2-rank run, the rest from the 1-rank run (a partial step replays).
    trained = [r for r in before if r["step"] < stop] + after
    assert {r["step"] for r in after} == set(range(stop, STEPS))
    ids = [r["id"] for r in trained]
    assert sorted(ids) == list(range(STEPS * GBS)), "a sample was skipped or trained twice"
    for r in trained:
        assert r["id"] // GBS == r["step"]
    per_source = Counter(r["source"] for r in trained)
    assert abs(per_source["fineweb"] - 0.7 * STEPS * GBS) <= 1 and sum(per_source.values()) == STEPS * GBS
    for name in ("fineweb", "nemotron"):
        rows = sorted(r["row"] for r in trained if r["source"] == name)
        assert rows == list(range(len(rows))), f"{name}: rows not consumed in order exactly once"

    # The same samples an uninterrupted single-process loader reads.
    from titanloop.data import DataConfig, SourceConfig, build_dataloader

    cfg = DataConfig(
        kind="shards",
        tokenizer=tokenizer,
        seed=3,
        shuffle_block=4,
        prefetch=0,
        sources=[SourceConfig(str(root / "fineweb"), 70.0), SourceConfig(str(root / "nemotron"), 30.0)],
        trace_samples=str(tmp_path / "reference"),
    )
    ld = build_dataloader(
        cfg, seq_len=SEQ, micro_batch_size=MBS, global_batch_size=GBS, dp_rank=0, dp_world=1, vocab_size=VOCAB
    )
    for _ in range(STEPS * GBS // MBS):
        next(ld)
    ld.close()
    reference = {r["id"]: (r["source"], r["row"], r["tokens"]) for r in records(tmp_path / "reference")}
    assert {r["id"]: (r["source"], r["row"], r["tokens"]) for r in trained} == reference
