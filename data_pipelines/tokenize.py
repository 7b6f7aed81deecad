"""Tokenize text corpora into MDS or webdataset shards: FineWeb / FineWeb-Edu parquet, Nemotron-CC and other
JSON lines (.jsonl, .jsonl.zst; a `text` field), and plain UTF-8 text (.txt).

    python -m data_pipelines.tokenize --tokenizer tokenizer.json --source fineweb-edu \
        --format mds --out /data/shards/fineweb-edu  /data/raw/fineweb-edu/  [--workers 8]
    python -m data_pipelines.tokenize --tokenizer char.json --out shards/shakespeare \
        --holdout 0.1 --holdout-out shards/shakespeare-val  input.txt

Every input file becomes one part (part-NNNNN...), tokenized by one worker process, documents in file
order, each followed by EOS; parts are numbered by sorted input path, so the output does not depend on
--workers. A manifest.json (source, documents, tokens, tokenizer fingerprint, per-shard sha1) is written
last. Inputs and --out may be local paths or s3:// / gs:// URLs (pyarrow / mosaicml-streaming handle them).

Plain text: --doc-split says where a document ends (file: the whole file, the default; paragraph: blank lines;
line: every line; start=REGEX: a new document at each line matching REGEX).

Held-out split: --holdout F writes the last F of the corpus's characters (inputs in sorted order, documents in
file order) to a second shard set, --holdout-out, for `[validation.data]`; the document that straddles the cut is
cut there, so a one-file corpus of n characters splits as `text[:int((1 - F) * n)]` / the rest (nanoGPT's
split). It reads the inputs twice (the first
pass counts characters).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import sys
import threading
import time

from data_pipelines.readers import TextSplit

BATCH_DOCS = 256
FORMATS = ("mds", "webdataset")
DEFAULT_SHARD_BYTES = 64 << 20  # = titanloop.data.shard_format.DEFAULT_SHARD_BYTES


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m data_pipelines.tokenize",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("inputs", nargs="+", help="parquet / .jsonl / .jsonl.zst(d) / .txt files or directories (recursive)")
    p.add_argument("--tokenizer", required=True, help="path of a Hugging Face tokenizer.json")
    p.add_argument("--out", required=True, help="output shard-set directory (must be new or empty) or URL")
    p.add_argument("--format", choices=FORMATS, default="mds", help="shard format (default: mds)")
    p.add_argument("--source", default=None, help="source name recorded in the manifest (default: --out basename)")
    p.add_argument("--text-column", default="text", help="column / key holding the document text (default: text)")
    p.add_argument(
        "--eos-token",
        default=None,
        help="EOS token appended after every document "
        "(default: the first of <|endoftext|>, </s>, <eos>, ... in the vocabulary)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=max(1, min(8, os.cpu_count() or 1)),
        help="processes, one input file at a time each (default: min(8, CPUs))",
    )
    p.add_argument(
        "--shard-bytes",
        type=int,
        default=DEFAULT_SHARD_BYTES,
        help=f"shard size limit in bytes (default: {DEFAULT_SHARD_BYTES})",
    )
    p.add_argument("--min-tokens", type=int, default=1, help="drop documents with fewer tokens (before EOS)")
    p.add_argument(
        "--doc-split",
        default="file",
        help="plain text (.txt): file (one document per file, default) | paragraph (split at blank lines) | "
        "line (one document per line) | start=REGEX (a document starts at each matching line)",
    )
    p.add_argument(
        "--holdout",
        type=float,
        default=0.0,
        help="write the last FRACTION of the characters (0 < F < 1) to --holdout-out instead (default 0: none)",
    )
    p.add_argument("--holdout-out", default=None, help="shard-set directory (new or empty) or URL of the held-out part")
    args = p.parse_args(argv)
    try:
        args.text_split = TextSplit.parse(args.doc_split)
    except ValueError as e:
        p.error(str(e))
    if not 0 <= args.holdout < 1:
        p.error(f"--holdout {args.holdout} is invalid: expected a fraction 0 < F < 1 (0: no held-out split)")
    if (args.holdout > 0) != (args.holdout_out is not None):
        p.error("--holdout and --holdout-out go together: e.g. --holdout 0.1 --holdout-out shards/corpus-val")
    if args.holdout_out is not None and args.holdout_out.rstrip("/") == args.out.rstrip("/"):
        p.error("--holdout-out must differ from --out")
    return args


def count_chars(job) -> int:
    """Worker of the held-out split's first pass: the characters of one input file's documents."""
    path, args = job
    from data_pipelines.readers import read_documents

    return sum(len(text) for text, _, _ in read_documents(path, args.text_column, args.text_split))


def tokenize_file(job) -> tuple[int, list, int, int, list]:
    """Worker: one input file -> one part of shards (and one of the held-out set, if the file reaches past the
    split). Returns (part, shard infos, documents, tokens, held-out shard infos)."""
    from data_pipelines.readers import read_documents
    from titanloop.data.shard_format import ShardWriter, token_dtype
    from titanloop.data.tokenizer import load_tokenizer

    part, path, args, fingerprint, eos_id, vocab_size, train_chars, progress = job
    progress = progress or _worker_progress
    tokenizer = load_tokenizer(args.tokenizer)
    dtype = token_dtype(vocab_size)
    writers = {"train": ShardWriter(args.format, args.local_out, part, dtype, fingerprint, args.shard_bytes)}
    docs = tokens = 0
    batch: list[tuple[str, str, dict, str]] = []
    offset = 0  # characters of this file's documents so far

    def writer(split: str):
        if split not in writers:  # the held-out part exists only for files that reach past the split
            writers[split] = ShardWriter(args.format, args.local_holdout, part, dtype, fingerprint, args.shard_bytes)
        return writers[split]

    def flush():
        nonlocal docs, tokens
        encodings = tokenizer.encode_batch([text for text, _, _, _ in batch], add_special_tokens=False)
        n_tok = 0
        for (_, doc_id, meta, split), enc in zip(batch, encodings):
            if len(enc.ids) < args.min_tokens:
                continue
            writer(split).write(enc.ids + [eos_id], doc_id, 0, meta)
            docs += 1
            n_tok += len(enc.ids) + 1
        tokens += n_tok
        progress.put((0, n_tok))
        batch.clear()

    try:
        for text, doc_id, meta in read_documents(path, args.text_column, args.text_split):
            in_train = train_chars is None or offset < train_chars  # where the document starts
            cut = len(text) if train_chars is None else min(max(train_chars - offset, 0), len(text))
            offset += len(text)
            if cut > 0 or (not text and in_train):
                batch.append((text[:cut], doc_id, meta, "train"))
            if cut < len(text) or (not text and not in_train):
                batch.append((text[cut:], doc_id, meta, "holdout"))
            if len(batch) >= BATCH_DOCS:
                flush()
        if batch:
            flush()
        shards = writers["train"].finish()
        held = writers["holdout"].finish() if "holdout" in writers else []
    except SystemExit:
        raise
    except Exception as e:
        raise SystemExit(f"error: input {path}: {type(e).__name__}: {e}") from None
    progress.put((1, 0))
    return part, shards, docs, tokens, held


class _Progress:
    """Progress sink for in-process work; `put((file_done, tokens))` like the worker queue."""

    def __init__(self, bar, n_files: int, source: str):
        self.bar, self.n_files, self.source, self.files_done = bar, n_files, source, 0

    def put(self, item) -> None:
        done, n_tok = item
        self.bar.update(n_tok)
        if done:
            self.files_done += 1
            self.bar.set_description(f"{self.source} {self.files_done}/{self.n_files} files")


def _run_pool(args, jobs: list, sink: _Progress | None, fn=None) -> list:
    """Run `fn` (default tokenize_file) over `jobs` in worker processes. Fork is used only from a
    single-threaded process (forking while other threads hold locks can deadlock the child); otherwise spawn."""
    ctx = mp.get_context("fork" if threading.active_count() == 1 else "spawn")
    progress = ctx.Queue()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with ctx.Pool(min(args.workers, len(jobs)), initializer=_init_worker, initargs=(progress,)) as pool:
        pending = pool.map_async(fn or tokenize_file, jobs, chunksize=1)
        while not (pending.ready() and progress.empty()):
            try:
                item = progress.get(timeout=0.2)
            except queue.Empty:
                continue
            if sink is not None:
                sink.put(item)
        return pending.get()  # re-raises a worker's SystemExit with its one-line message


_worker_progress = None


def _init_worker(progress) -> None:
    global _worker_progress
    _worker_progress = progress


def main(argv=None) -> None:
    args = parse_args(argv)  # heavy imports only after --help / argument errors
    from titanloop.data.shard_output import OutputDir
    from data_pipelines.readers import list_inputs
    from titanloop.config_errors import ConfigError
    from titanloop.data.shard_format import Manifest, token_dtype
    from titanloop.data.tokenizer import tokenizer_record

    if args.workers < 1:
        raise SystemExit("error: --workers must be >= 1")
    try:
        tok = tokenizer_record(args.tokenizer, args.eos_token)
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
    fingerprint, eos_id, vocab_size = tok["fingerprint"], tok["eos_id"], tok["vocab_size"]
    inputs = list_inputs(args.inputs)
    if not inputs:
        raise SystemExit(f"error: no parquet / jsonl(.zst) / txt files found in {args.inputs}")
    out = OutputDir(args.out)
    holdout = OutputDir(args.holdout_out) if args.holdout_out else None
    args.local_out, args.local_holdout = out.local, holdout.local if holdout else None
    source = args.source or os.path.basename(args.out.rstrip("/"))
    print(
        f"tokenizing {len(inputs)} file(s) with {args.tokenizer} ({fingerprint[:17]}, vocab {vocab_size}, "
        f"eos {eos_id}) -> {args.format} {args.out}",
        file=sys.stderr,
    )

    if args.format == "mds":
        import streaming  # noqa: F401  (slow import: once here, inherited by forked workers)
    from tqdm import tqdm

    tqdm.monitor_interval = 0  # no monitor thread: keeps the process single-threaded for fork
    start = time.time()
    in_process = args.workers == 1 or len(inputs) == 1
    train_chars = [None] * len(inputs)  # characters of each file that go to --out (None: all)
    if holdout is not None:
        print(f"counting characters for the held-out split ({args.holdout:g} of the corpus)", file=sys.stderr)
        jobs = [(path, args) for path in inputs]
        counts = [count_chars(j) for j in jobs] if in_process else _run_pool(args, jobs, None, count_chars)
        keep = int((1 - args.holdout) * sum(counts))
        before = [sum(counts[:i]) for i in range(len(counts))]
        train_chars = [min(max(keep - b, 0), c) for b, c in zip(before, counts)]
    bar = tqdm(
        total=None,
        unit="tok",
        unit_scale=True,
        desc=f"{source} 0/{len(inputs)} files",
        file=sys.stderr,
        mininterval=0.5,
    )
    jobs = [(i, path, args, fingerprint, eos_id, vocab_size, train_chars[i]) for i, path in enumerate(inputs)]
    if in_process:
        progress = _Progress(bar, len(inputs), source)
        results = [tokenize_file((*job, progress)) for job in jobs]
    else:
        results = _run_pool(args, [(*job, None) for job in jobs], _Progress(bar, len(inputs), source))
    bar.close()
    secs = time.time() - start
    results = sorted(results, key=lambda r: r[0])
    sets = [(out, args.out, source, 1)] + ([(holdout, args.holdout_out, f"{source}-holdout", 4)] if holdout else [])
    for target, where, name, column in sets:
        manifest = Manifest(
            format=args.format, source=name, dtype=token_dtype(vocab_size), tokenizer=tok, inputs=inputs
        )
        for r in results:
            manifest.shards += r[column]
        target.publish(manifest)
        print(
            f"wrote {manifest.documents} documents, {manifest.tokens} tokens in {len(manifest.shards)} shards to "
            f"{where} ({manifest.tokens / max(secs, 1e-9):,.0f} tokens/s)",
            file=sys.stderr,
        )


if __name__ == "__main__":
    main()
