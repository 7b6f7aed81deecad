"""Tokenize FineWeb / FineWeb-Edu parquet and Nemotron-CC jsonl(.zst) into MDS or webdataset shards.

    python -m data_pipelines.tokenize --tokenizer tokenizer.json --source fineweb-edu \
        --format mds --out /data/shards/fineweb-edu  /data/raw/fineweb-edu/  [--workers 8]

Every input file becomes one part (part-NNNNN...), tokenized by one worker process, documents in file
order, each followed by EOS; parts are numbered by sorted input path, so the output does not depend on
--workers. A manifest.json (source, documents, tokens, tokenizer fingerprint, per-shard sha1) is written
last. Inputs and --out may be local paths or s3:// / gs:// URLs (pyarrow / mosaicml-streaming handle them).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import sys
import threading
import time

BATCH_DOCS = 256
FORMATS = ("mds", "webdataset")
DEFAULT_SHARD_BYTES = 64 << 20  # = titanloop.data.shard_format.DEFAULT_SHARD_BYTES


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m data_pipelines.tokenize",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("inputs", nargs="+", help="parquet / .jsonl / .jsonl.zst(d) files or directories (recursive)")
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
    return p.parse_args(argv)


def tokenize_file(job) -> tuple[int, list, int, int]:
    """Worker: one input file -> one part of shards. Returns (part, shard infos, documents, tokens)."""
    from data_pipelines.readers import read_documents
    from titanloop.data.shard_format import ShardWriter, token_dtype
    from titanloop.data.tokenizer import load_tokenizer

    part, path, args, fingerprint, eos_id, vocab_size, progress = job
    progress = progress or _worker_progress
    tokenizer = load_tokenizer(args.tokenizer)
    writer = ShardWriter(args.format, args.local_out, part, token_dtype(vocab_size), fingerprint, args.shard_bytes)
    docs = tokens = 0
    batch: list[tuple[str, str, dict]] = []

    def flush():
        nonlocal docs, tokens
        encodings = tokenizer.encode_batch([text for text, _, _ in batch], add_special_tokens=False)
        n_tok = 0
        for (_, doc_id, meta), enc in zip(batch, encodings):
            if len(enc.ids) < args.min_tokens:
                continue
            writer.write(enc.ids + [eos_id], doc_id, 0, meta)
            docs += 1
            n_tok += len(enc.ids) + 1
        tokens += n_tok
        progress.put((0, n_tok))
        batch.clear()

    try:
        for doc in read_documents(path, args.text_column):
            batch.append(doc)
            if len(batch) == BATCH_DOCS:
                flush()
        if batch:
            flush()
        shards = writer.finish()
    except SystemExit:
        raise
    except Exception as e:
        raise SystemExit(f"error: input {path}: {type(e).__name__}: {e}") from None
    progress.put((1, 0))
    return part, shards, docs, tokens


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


def _run_pool(args, inputs, fingerprint, eos_id, vocab_size, sink: _Progress) -> list:
    """Tokenize files in worker processes. Fork is used only from a single-threaded process (forking
    while other threads hold locks can deadlock the child); otherwise spawn."""
    ctx = mp.get_context("fork" if threading.active_count() == 1 else "spawn")
    progress = ctx.Queue()
    jobs = [(i, path, args, fingerprint, eos_id, vocab_size, None) for i, path in enumerate(inputs)]
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with ctx.Pool(min(args.workers, len(inputs)), initializer=_init_worker, initargs=(progress,)) as pool:
        pending = pool.map_async(tokenize_file, jobs, chunksize=1)
        while not (pending.ready() and progress.empty()):
            try:
                sink.put(progress.get(timeout=0.2))
            except queue.Empty:
                pass
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
        raise SystemExit(f"error: no parquet / jsonl(.zst) files found in {args.inputs}")
    out = OutputDir(args.out)
    args.local_out = out.local
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
    bar = tqdm(
        total=None,
        unit="tok",
        unit_scale=True,
        desc=f"{source} 0/{len(inputs)} files",
        file=sys.stderr,
        mininterval=0.5,
    )
    start = time.time()
    if args.workers == 1 or len(inputs) == 1:
        progress = _Progress(bar, len(inputs), source)
        results = [
            tokenize_file((i, path, args, fingerprint, eos_id, vocab_size, progress)) for i, path in enumerate(inputs)
        ]
    else:
        results = _run_pool(args, inputs, fingerprint, eos_id, vocab_size, _Progress(bar, len(inputs), source))
    bar.close()
    manifest = Manifest(format=args.format, source=source, dtype=token_dtype(vocab_size), tokenizer=tok, inputs=inputs)
    for _, shards, _, _ in sorted(results, key=lambda r: r[0]):
        manifest.shards += shards
    out.publish(manifest)
    secs = time.time() - start
    print(
        f"wrote {manifest.documents} documents, {manifest.tokens} tokens in {len(manifest.shards)} shards to "
        f"{args.out} ({manifest.tokens / max(secs, 1e-9):,.0f} tokens/s)",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
