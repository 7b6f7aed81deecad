"""Bad shards fail with one line naming the shard (or are skipped with a warning and a counter)."""

import json
import logging
import os

import numpy as np
import pytest

from data_pipelines import tokenize
from data_pipelines.sample_corpus import train_tokenizer, write_fineweb_parquet
from titanloop.config_errors import ConfigError
from titanloop.data import DataConfig, ShardError, SourceConfig, build_dataloader
from titanloop.data.shard_output import write_shard_set

TOKENIZER = {"fingerprint": "sha1:test-tokenizer-a", "vocab_size": 256, "eos_id": 0}


def token_set(path, fmt="mds", n_docs=120, seed=0, tokenizer=TOKENIZER):
    rng = np.random.default_rng(seed)
    docs = ((np.append(rng.integers(1, 256, int(rng.integers(20, 200))), 0), f"d{i}", 0, {}) for i in range(n_docs))
    return write_shard_set(str(path), fmt, os.path.basename(str(path)), docs, tokenizer, shard_bytes=8000)


def loader(path, fmt="mds", vocab_size=256, **kw):
    cfg = DataConfig(kind=fmt, sources=[SourceConfig(str(path))], shuffle_block=8, prefetch=0, **kw)
    return build_dataloader(
        cfg, seq_len=32, micro_batch_size=4, global_batch_size=4, dp_rank=0, dp_world=1, vocab_size=vocab_size
    )


def drain(ld, steps=200):
    for _ in range(steps):
        next(ld)


def one_line(err, *needles):
    msg = str(err.value)
    assert "\n" not in msg, msg
    for n in needles:
        assert n in msg, msg


def flip_token_bytes(root, info):
    """Flip 4 token bytes of the shortest document of a shard (a document some read covers whole)."""
    from titanloop.data.shard_format import ShardIndex

    raw = (root / info.index).read_bytes()
    idx = ShardIndex.parse_head(raw, "idx")
    records = ShardIndex.parse_records(raw[idx.head_bytes :])
    at = int(records[int(np.argmin(np.diff(idx.token_start))), 1]) + 2  # payload_off of the shortest document
    with open(root / info.path, "r+b") as f:
        f.seek(at)
        chunk = f.read(4)
        f.seek(at)
        f.write(bytes(b ^ 0xFF for b in chunk))


@pytest.mark.parametrize("fmt", ["mds", "webdataset"])
def test_corrupt_shard_fails_when_read_naming_it(tmp_path, fmt):
    """Flipped token bytes (same size) fail the document's crc32 when a read covers the document."""
    m = token_set(tmp_path / "s", fmt)
    victim = m.shards[1].path
    flip_token_bytes(tmp_path / "s", m.shards[1])
    ld = loader(tmp_path / "s", fmt)
    with pytest.raises(ShardError) as e:
        drain(ld)
    one_line(e, victim, "corrupt")


@pytest.mark.parametrize("fmt", ["mds", "webdataset"])
def test_truncated_and_missing_shards_fail_at_startup(tmp_path, fmt):
    m = token_set(tmp_path / "s", fmt)
    path = tmp_path / "s" / m.shards[0].path
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ShardError) as e:
        loader(tmp_path / "s", fmt)
    one_line(e, m.shards[0].path, "truncated")
    os.remove(tmp_path / "s" / m.shards[2].path)
    path.unlink()
    with pytest.raises(ShardError) as e:
        loader(tmp_path / "s", fmt)
    one_line(e, m.shards[0].path, "missing")


def test_truncated_shard_is_caught_on_read_even_without_checksums(tmp_path):
    m = token_set(tmp_path / "s")
    ld = loader(tmp_path / "s", verify_checksums=False)
    path = tmp_path / "s" / m.shards[1].path
    path.write_bytes(path.read_bytes()[: m.shards[1].bytes // 2] + bytes(m.shards[1].bytes // 2))  # zero tail
    with pytest.raises(ShardError) as e:
        drain(ld)
    one_line(e, m.shards[1].path)


def test_shard_set_from_another_tokenizer_is_refused(tmp_path):
    write_fineweb_parquet(str(tmp_path / "000.parquet"), 30, seed=1)
    train_tokenizer(str(tmp_path / "tok_a.json"), vocab_size=300)
    train_tokenizer(str(tmp_path / "tok_b.json"), vocab_size=280)
    tokenize.main(
        [
            "--tokenizer",
            str(tmp_path / "tok_b.json"),
            "--out",
            str(tmp_path / "b"),
            "--workers",
            "1",
            str(tmp_path / "000.parquet"),
        ]
    )
    with pytest.raises(ShardError) as e:
        loader(tmp_path / "b", vocab_size=512, tokenizer=str(tmp_path / "tok_a.json"))
    one_line(e, "manifest.json", "tokenizer")
    assert next(loader(tmp_path / "b", vocab_size=512, tokenizer=str(tmp_path / "tok_b.json")))["input_ids"].numel()


def test_single_foreign_shard_in_a_set_is_named(tmp_path):
    m = token_set(tmp_path / "s")
    manifest = json.loads((tmp_path / "s/manifest.json").read_text())
    manifest["shards"][1]["tokenizer"] = "sha1:some-other-tokenizer"
    (tmp_path / "s/manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ShardError) as e:
        loader(tmp_path / "s")
    one_line(e, m.shards[1].path, "sha1:some-other-tokenizer")


def test_skip_mode_masks_rows_warns_and_counts(tmp_path, caplog):
    m = token_set(tmp_path / "s")
    flip_token_bytes(tmp_path / "s", m.shards[1])
    ld = loader(tmp_path / "s", on_bad_shard="skip")
    masked = good = 0
    with caplog.at_level(logging.WARNING):
        for _ in range(60):
            batch = next(ld)
            for labels in batch["labels"]:
                if (labels == -100).all():
                    masked += 1
                else:
                    good += 1
    assert masked > 0 and good > 0
    stats = ld.stats()["s"]
    assert stats["bad_shards"] == 1 and stats["bad_rows"] == masked
    assert sum(m.shards[1].path in r.getMessage() for r in caplog.records) == 1  # warned once


def test_config_mismatches_are_config_errors(tmp_path):
    token_set(tmp_path / "s", "mds")
    with pytest.raises(ConfigError, match="data.kind"):
        loader(tmp_path / "s", "webdataset")
    with pytest.raises(ShardError, match="manifest.json: missing"):
        loader(tmp_path)
    with pytest.raises(ConfigError, match="vocab_size"):
        build_dataloader(
            DataConfig(kind="mds", sources=[SourceConfig(str(tmp_path / "s"))]),
            seq_len=32,
            micro_batch_size=1,
            global_batch_size=1,
            dp_rank=0,
            dp_world=1,
            vocab_size=100,
        )
    with pytest.raises(ConfigError, match="data.sources"):
        DataConfig(kind="mds")
