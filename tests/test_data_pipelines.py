"""Raw corpora in the real schemas -> tokenize -> MDS / webdataset shards -> read back token-exact."""

import json
import os
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest
import zstandard

from data_pipelines import stats, synthetic, tokenize
from data_pipelines.readers import read_documents
from data_pipelines.sample_corpus import write_sample_corpus
from titanloop.data import DataConfig, SourceConfig, build_dataloader
from titanloop.data.shard_format import MANIFEST, Manifest, decode_shard
from titanloop.data.shards import ShardFetcher
from titanloop.data.tokenizer import load_tokenizer, tokenizer_fingerprint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_sample_corpus(str(tmp_path_factory.mktemp("corpus")), files=2, docs=40, vocab_size=400)


def read_set(path):
    with open(os.path.join(path, MANIFEST)) as f:
        m = Manifest.from_json(f.read(), path)
    fetch = ShardFetcher(path, None)
    shards = [decode_shard(m.format, fetch.read(s.path), m.dtype, s.path) for s in m.shards]
    return m, shards


def expected_documents(corpus, paths):
    tok = load_tokenizer(corpus["tokenizer"])
    eos = tok.token_to_id("<|endoftext|>")
    docs = []
    for path in paths:
        for text, doc_id, meta in read_documents(path):
            docs.append((tok.encode(text, add_special_tokens=False).ids + [eos], doc_id, meta))
    return docs


def test_sample_corpus_has_the_real_schemas(corpus):
    parquet = sorted(os.listdir(corpus["fineweb"]))[0]
    cols = pq.ParquetFile(os.path.join(corpus["fineweb"], parquet)).schema_arrow.names
    assert {"text", "id", "dump", "url", "language_score", "token_count", "int_score"} <= set(cols)
    jsonl = sorted(os.listdir(corpus["nemotron"]))[0]
    with open(os.path.join(corpus["nemotron"], jsonl), "rb") as f:
        first = json.loads(zstandard.ZstdDecompressor().decompress(f.read(), max_output_size=1 << 26).split(b"\n")[0])
    assert {"text", "warc_record_id", "url"} <= set(first)


@pytest.mark.parametrize("fmt", ["mds", "webdataset"])
def test_tokenize_roundtrip_is_token_exact(corpus, tmp_path, fmt):
    out = str(tmp_path / fmt)
    inputs = [corpus["fineweb"], corpus["nemotron"]]
    workers = "2" if fmt == "webdataset" else "1"  # one multiprocess run is enough (spawn re-imports torch)
    tokenize.main(
        [
            "--tokenizer",
            corpus["tokenizer"],
            "--out",
            out,
            "--format",
            fmt,
            "--workers",
            workers,
            "--shard-bytes",
            "20000",
            "--source",
            "mix",
            *inputs,
        ]
    )
    m, shards = read_set(out)
    files = sorted(os.path.join(d, f) for d in inputs for f in os.listdir(d))
    want = expected_documents(corpus, files)
    got_tokens = [s.tokens[a:b].tolist() for s in shards for a, b in zip(s.doc_starts[:-1], s.doc_starts[1:])]
    assert len(m.shards) > 2 and m.format == fmt and m.source == "mix"
    assert got_tokens == [w[0] for w in want]
    assert [i for s in shards for i in s.ids] == [w[1] for w in want]
    assert m.documents == len(want) and m.tokens == sum(len(w[0]) for w in want)
    assert m.tokenizer["fingerprint"] == tokenizer_fingerprint(corpus["tokenizer"])
    assert m.inputs == files

    # The loader (one lane, stream order) reproduces the token stream of the epoch's shard order exactly,
    # with document ids.
    seq = 64
    cfg = DataConfig(kind=fmt, sources=[SourceConfig(out)], tokenizer=corpus["tokenizer"], shuffle_block=1, prefetch=0)
    loader = build_dataloader(
        cfg, seq_len=seq, micro_batch_size=1, global_batch_size=1, dp_rank=0, dp_world=1, vocab_size=400
    )
    docs = [
        s.tokens[a:b]
        for i in loader.sources[0]._epoch(0)[0]
        for s in [shards[i]]
        for a, b in zip(s.doc_starts[:-1], s.doc_starts[1:])
    ]
    stream = np.concatenate(docs)
    rows = [next(loader) for _ in range(20)]
    inputs_ = np.concatenate([r["input_ids"].reshape(-1).numpy() for r in rows])
    assert np.array_equal(inputs_, stream[: len(inputs_)])
    labels = np.concatenate([r["labels"].reshape(-1).numpy() for r in rows])
    assert np.array_equal(labels, stream[1 : len(labels) + 1])
    starts = np.cumsum([len(d) for d in docs])  # document starts in the stream (after each EOS)
    first_row_docs = rows[0]["doc_ids"][0].numpy()
    assert np.array_equal(np.flatnonzero(np.diff(first_row_docs)) + 1, starts[starts < seq])


def test_output_is_independent_of_worker_count(corpus, tmp_path):
    sha = []
    for workers in ("1", "2"):
        out = str(tmp_path / f"w{workers}")
        tokenize.main(
            [
                "--tokenizer",
                corpus["tokenizer"],
                "--out",
                out,
                "--format",
                "webdataset",
                "--workers",
                workers,
                corpus["nemotron"],
            ]
        )
        sha.append([s.sha1 for s in read_set(out)[0].shards])
    assert sha[0] == sha[1]


def test_cli_errors_are_one_line_and_nothing_is_overwritten(corpus, tmp_path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    cases = [
        (["--tokenizer", corpus["tokenizer"], "--out", str(out), corpus["fineweb"]], "not empty"),
        (["--tokenizer", str(tmp_path / "nope.json"), "--out", str(tmp_path / "a"), corpus["fineweb"]], "tokenizer="),
        (
            ["--tokenizer", corpus["tokenizer"], "--out", str(tmp_path / "b"), str(tmp_path / "missing")],
            "does not exist",
        ),
        (
            [
                "--tokenizer",
                corpus["tokenizer"],
                "--out",
                str(tmp_path / "c"),
                "--eos-token",
                "<nope>",
                corpus["fineweb"],
            ],
            "eos_token",
        ),
    ]
    for argv, needle in cases:
        with pytest.raises(SystemExit) as e:
            tokenize.main(argv)
        msg = str(e.value)
        assert msg.startswith("error:") and needle in msg and "\n" not in msg
    assert (out / "keep.txt").read_text() == "precious"


def test_stats_and_synthetic_cli(tmp_path, capsys):
    synthetic.main(
        [
            "--task",
            "addition",
            "--out",
            str(tmp_path / "add"),
            "--format",
            "webdataset",
            "--train-docs",
            "300",
            "--eval-examples",
            "50",
            "--option",
            "n_digits=3",
        ]
    )
    stats.main(
        [str(tmp_path / "add/train"), str(tmp_path / "add/eval"), "--verify", "--json", str(tmp_path / "s.json")]
    )
    table = capsys.readouterr().out
    assert "addition-train" in table and "addition-eval" in table
    report = json.loads((tmp_path / "s.json").read_text())
    assert report["sets"][0]["documents"] == 300 and report["sets"][1]["documents"] == 50
    # prompt tokens are not targets when the task is read back from shards
    cfg = DataConfig(kind="webdataset", sources=[SourceConfig(str(tmp_path / "add/train"))], prefetch=0)
    batch = next(
        build_dataloader(cfg, seq_len=48, micro_batch_size=2, global_batch_size=2, dp_rank=0, dp_world=1, vocab_size=64)
    )
    assert (batch["labels"] == -100).float().mean() > 0.4


@pytest.mark.parametrize("tool", ["tokenize", "synthetic", "stats", "sample_corpus"])
def test_cli_help(tool):
    r = subprocess.run(
        [sys.executable, "-m", f"data_pipelines.{tool}", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0 and "usage: python -m data_pipelines." in r.stdout
