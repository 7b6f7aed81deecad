"""Write small corpora in the real FineWeb and Nemotron-CC schemas, and a tiny BPE tokenizer trained on them.

    python -m data_pipelines.sample_corpus --out /tmp/corpus --files 2 --docs 500

Produces `fineweb/*.parquet` (FineWeb-Edu columns: text, id, dump, url, date, file_path, language,
language_score, token_count, score, int_score), `nemotron/*.jsonl.zst` (Nemotron-CC keys: warc_record_id,
url, text, quality) and `tokenizer.json` (byte-level BPE, `<|endoftext|>` = id 0). Nothing is downloaded:
tests, the benchmark and the demo use it to exercise the pipelines end to end. Text is seeded pseudo-English.
--out must be new or empty (--overwrite writes over the files of an earlier sample corpus).
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from data_pipelines.cli import InputError, add_debug_flag, check_output_dir, errors_as_one_line

SYLLABLES = [
    "ka",
    "lo",
    "mi",
    "ten",
    "ra",
    "shu",
    "vo",
    "pel",
    "dan",
    "qui",
    "or",
    "es",
    "ith",
    "um",
    "zen",
    "bra",
    "fo",
    "gil",
    "ny",
    "cet",
    "wa",
    "ro",
    "lin",
    "ta",
    "mu",
    "sel",
    "fa",
    "dro",
    "ki",
    "pe",
]


def _words(rng, n_words: int = 400) -> list[str]:
    return ["".join(rng.choice(SYLLABLES, size=rng.integers(1, 4))) for _ in range(n_words)]


def make_texts(n: int, seed: int) -> list[str]:
    """`n` seeded pseudo-English documents of 20-400 words (Zipf-distributed vocabulary)."""
    rng = np.random.default_rng(seed)
    vocab = _words(np.random.default_rng(12345))
    p = 1.0 / np.arange(1, len(vocab) + 1)
    p /= p.sum()
    texts = []
    for _ in range(n):
        words = rng.choice(vocab, size=int(rng.integers(20, 400)), p=p).tolist()
        sentences, i = [], 0
        while i < len(words):
            k = int(rng.integers(5, 16))
            sentences.append(" ".join(words[i : i + k]).capitalize() + ".")
            i += k
        texts.append(" ".join(sentences))
    return texts


def write_fineweb_parquet(path: str, n_docs: int, seed: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = make_texts(n_docs, seed)
    rng = np.random.default_rng(seed + 1)
    score = rng.uniform(2.5, 5.0, size=n_docs)
    table = pa.table(
        {
            "text": texts,
            "id": [f"<urn:uuid:{seed:04d}-{i:08d}>" for i in range(n_docs)],
            "dump": ["CC-MAIN-2024-10"] * n_docs,
            "url": [f"https://example.org/{seed}/{i}" for i in range(n_docs)],
            "date": ["2024-02-21T10:00:00Z"] * n_docs,
            "file_path": [f"s3://commoncrawl/crawl-data/CC-MAIN-2024-10/segments/{seed}.warc.gz"] * n_docs,
            "language": ["en"] * n_docs,
            "language_score": pa.array(rng.uniform(0.65, 1.0, size=n_docs), pa.float64()),
            "token_count": pa.array([len(t.split()) for t in texts], pa.int64()),
            "score": pa.array(score, pa.float64()),
            "int_score": pa.array(np.round(score).astype(np.int64), pa.int64()),
        }
    )
    pq.write_table(table, path, row_group_size=max(1, n_docs // 4))


def write_nemotron_jsonl_zst(path: str, n_docs: int, seed: int) -> None:
    import zstandard

    lines = [
        json.dumps(
            {
                "warc_record_id": f"{seed:04d}-{i:08d}",
                "url": f"https://example.net/{seed}/{i}",
                "text": t,
                "quality": ["high", "medium-high", "medium"][i % 3],
            }
        )
        for i, t in enumerate(make_texts(n_docs, seed))
    ]
    with open(path, "wb") as f:
        f.write(zstandard.ZstdCompressor(level=3).compress(("\n".join(lines) + "\n").encode("utf-8")))


def train_tokenizer(path: str, vocab_size: int = 512, seed: int = 0) -> None:
    """A byte-level BPE tokenizer.json trained on sample text; `<|endoftext|>` is id 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(make_texts(300, seed + 99), trainer=trainer)
    tok.save(path)


def write_sample_corpus(out: str, files: int = 2, docs: int = 200, vocab_size: int = 512, seed: int = 0) -> dict:
    """Write the corpus; return {"fineweb": dir, "nemotron": dir, "tokenizer": path}."""
    paths = {
        "fineweb": os.path.join(out, "fineweb"),
        "nemotron": os.path.join(out, "nemotron"),
        "tokenizer": os.path.join(out, "tokenizer.json"),
    }
    os.makedirs(paths["fineweb"], exist_ok=True)
    os.makedirs(paths["nemotron"], exist_ok=True)
    for i in range(files):
        write_fineweb_parquet(os.path.join(paths["fineweb"], f"{i:03d}_00000.parquet"), docs, seed + 2 * i)
        write_nemotron_jsonl_zst(os.path.join(paths["nemotron"], f"part-{i:05d}.jsonl.zst"), docs, seed + 2 * i + 1)
    train_tokenizer(paths["tokenizer"], vocab_size, seed)
    return paths


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m data_pipelines.sample_corpus",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", required=True, help="directory to create")
    p.add_argument("--files", type=int, default=2, help="files per source (default: 2)")
    p.add_argument("--docs", type=int, default=200, help="documents per file (default: 200)")
    p.add_argument("--vocab-size", type=int, default=512, help="BPE vocabulary size (default: 512)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overwrite", action="store_true", help="write into a non-empty --out (files of the same name)")
    add_debug_flag(p)
    a = p.parse_args(argv)
    if a.files < 1 or a.docs < 1:
        p.error("--files and --docs must be >= 1")
    if a.vocab_size < 258:
        p.error(f"--vocab-size {a.vocab_size} is too small: a byte-level BPE needs >= 258")
    with errors_as_one_line(a.debug):
        if check_output_dir(a.out, "--out") and not a.overwrite:
            raise InputError(f"--out {a.out} is not empty: choose a new directory, or pass --overwrite")
        paths = write_sample_corpus(a.out, a.files, a.docs, a.vocab_size, a.seed)
    print(json.dumps(paths, indent=1))


if __name__ == "__main__":
    main()
