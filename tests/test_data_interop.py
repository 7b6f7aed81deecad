"""Round trips with the real shard libraries, both ways: sets written by data_pipelines are read by
`streaming.StreamingDataset` and `webdataset.WebDataset` with the same tokens; sets written by MDSWriter and
TarWriter themselves are read by titanloop (after `python -m data_pipelines.manifest`) with the same tokens."""

from __future__ import annotations

import os

import numpy as np
import pytest

from data_pipelines import manifest as manifest_cli
from data_pipelines import tokenize
from data_pipelines.sample_corpus import write_sample_corpus
from titanloop.data import DataConfig, SourceConfig, build_dataloader
from titanloop.data.shard_format import MANIFEST, Manifest, decode_shard
from titanloop.data.shards import ShardFetcher
from titanloop.data.tokenizer import find_eos_id, load_tokenizer

VOCAB, SEQ = 400, 32


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_sample_corpus(str(tmp_path_factory.mktemp("interop")), files=1, docs=40, vocab_size=VOCAB)


def titanloop_docs(path):
    with open(os.path.join(path, MANIFEST)) as f:
        m = Manifest.from_json(f.read(), path)
    fetch = ShardFetcher(path)
    out = []
    for info in m.shards:
        s = decode_shard(m.format, fetch.read(info.path), m.dtype, info.path)
        out += [(i, s.tokens[a:b].tolist()) for i, a, b in zip(s.ids, s.doc_starts[:-1], s.doc_starts[1:])]
    return out


def test_streaming_dataset_reads_data_pipelines_mds(corpus, tmp_path):
    from streaming import StreamingDataset

    out = str(tmp_path / "mds")
    tokenize.main(
        [
            "--tokenizer",
            corpus["tokenizer"],
            "--out",
            out,
            "--format",
            "mds",
            "--workers",
            "1",
            "--shard-bytes",
            "6000",
            corpus["fineweb"],
        ]
    )
    ds = StreamingDataset(local=out, shuffle=False, batch_size=1)
    theirs = [(x["id"], np.frombuffer(x["tokens"], np.uint16).tolist()) for x in ds]
    assert len(theirs) == 40 and theirs == titanloop_docs(out)


def test_webdataset_reads_data_pipelines_tars(corpus, tmp_path):
    import json

    import webdataset as wds

    out = tmp_path / "wds"
    tokenize.main(
        [
            "--tokenizer",
            corpus["tokenizer"],
            "--out",
            str(out),
            "--format",
            "webdataset",
            "--workers",
            "1",
            "--shard-bytes",
            "6000",
            corpus["nemotron"],
        ]
    )
    tars = sorted(str(p) for p in out.glob("*.tar"))
    assert len(tars) > 1
    theirs = [
        (json.loads(x["json"])["id"], np.frombuffer(x["tokens"], np.uint16).tolist())
        for x in wds.WebDataset(tars, shardshuffle=False)
    ]
    assert len(theirs) == 40 and theirs == titanloop_docs(str(out))


def foreign_documents(corpus):
    tok = load_tokenizer(corpus["tokenizer"])
    eos = find_eos_id(tok, None)
    rng = np.random.default_rng(0)
    return [
        np.asarray(tok.encode(" ".join(["ka lo mi"] * int(n)), add_special_tokens=False).ids + [eos], np.uint16)
        for n in rng.integers(5, 80, 60)
    ]


def write_foreign(fmt, root, docs):
    if fmt == "mds":
        from streaming import MDSWriter

        with MDSWriter(out=str(root), columns={"tokens": "bytes"}, size_limit=4000) as w:
            for d in docs:
                w.write({"tokens": d.tobytes()})
    else:
        import webdataset as wds

        os.makedirs(root)
        for i in range(0, len(docs), 20):
            with wds.TarWriter(str(root / f"their-{i // 20:03d}.tar")) as w:
                for j, d in enumerate(docs[i : i + 20]):
                    w.write({"__key__": f"doc{i + j:05d}", "tokens": d.tobytes()})


@pytest.mark.parametrize("fmt", ["mds", "webdataset"])
def test_titanloop_reads_sets_written_by_the_libraries(corpus, tmp_path, fmt):
    docs = foreign_documents(corpus)
    root = tmp_path / fmt
    write_foreign(fmt, root, docs)
    manifest_cli.main([str(root), "--format", fmt, "--tokenizer", corpus["tokenizer"]])
    assert [t for _, t in titanloop_docs(str(root))] == [d.tolist() for d in docs]
    # The loader's rows (one lane, stream order) are the stream of the epoch's shard order, token for token.
    cfg = DataConfig(
        kind=fmt, sources=[SourceConfig(str(root))], tokenizer=corpus["tokenizer"], shuffle_block=1, prefetch=0
    )
    ld = build_dataloader(
        cfg, seq_len=SEQ, micro_batch_size=1, global_batch_size=1, dp_rank=0, dp_world=1, vocab_size=VOCAB
    )
    src = ld.sources[0]
    per_shard, i = [], 0
    for info in src.manifest.shards:
        per_shard.append(np.concatenate([d for d in docs[i : i + info.documents]]))
        i += info.documents
    stream = np.concatenate([per_shard[s] for s in src._epoch(0)[0]])
    rows = np.concatenate([next(ld)["input_ids"][0].numpy() for _ in range(src.windows)])
    assert np.array_equal(rows, stream[: len(rows)]) and len(rows) == src.windows * SEQ
    ld.close()
