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

Outputs: --out and --holdout-out must be new or empty directories (or URL prefixes holding no objects), and
differ; --overwrite replaces an existing shard set there. A failed run removes the parts it wrote, so it can
simply be run again. The report names documents dropped (a null text, fewer than --min-tokens tokens) and
unknown tokens (characters the tokenizer lacks); a run that leaves a set with no tokens is an error.

An error (also one inside a worker process) ends the run at once: one line naming the file and line, exit 1;
--debug (or TITANLOOP_DEBUG=1) shows the traceback.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import threading
import time

from data_pipelines.cli import InputError, add_debug_flag, debug_enabled, errors_as_one_line, resolved
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
    p.add_argument("--out", required=True, help="output shard-set directory (new or empty, see --overwrite) or URL")
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
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a shard set already in --out / --holdout-out (default: refuse a non-empty output)",
    )
    add_debug_flag(p)
    args = p.parse_args(argv)
    try:
        args.text_split = TextSplit.parse(args.doc_split)
    except ValueError as e:
        p.error(str(e))
    if not 0 <= args.holdout < 1:
        p.error(f"--holdout {args.holdout} is invalid: expected a fraction 0 < F < 1 (0: no held-out split)")
    if (args.holdout > 0) != (args.holdout_out is not None):
        p.error("--holdout and --holdout-out go together: e.g. --holdout 0.1 --holdout-out shards/corpus-val")
    if args.holdout_out is not None and resolved(args.holdout_out) == resolved(args.out):
        p.error(f"--holdout-out {args.holdout_out} is --out {args.out}: give the held-out split its own directory")
    if args.workers < 1:
        p.error(f"--workers {args.workers} is invalid: expected an integer >= 1")
    if args.shard_bytes < 1:
        p.error(f"--shard-bytes {args.shard_bytes} is invalid: expected a size in bytes >= 1")
    if args.min_tokens < 0:
        p.error(f"--min-tokens {args.min_tokens} is invalid: expected an integer >= 0")
    return args


def _input_error(path: str, e: BaseException, debug: bool) -> BaseException:
    """A worker's failure as one InputError naming the input (kept as is when it already names it)."""
    if isinstance(e, InputError) or debug:
        return e
    from data_pipelines.cli import one_line

    return InputError(f"input {path}: {one_line(e)}")


def count_chars(job) -> int:
    """Worker of the held-out split's first pass: the characters of one input file's documents."""
    path, args = job
    from data_pipelines.readers import read_documents

    try:
        return sum(len(text or "") for text, _, _ in read_documents(path, args.text_column, args.text_split))
    except Exception as e:
        raise _input_error(path, e, args.debug) from None


def tokenize_file(job) -> tuple[int, list, int, int, list, dict]:
    """Worker: one input file -> one part of shards (and one of the held-out set, if the file reaches past the
    split). Returns (part, shard infos, documents, tokens, held-out shard infos, counts); counts are the
    documents dropped (`null`: no text, `short`: fewer than --min-tokens tokens) and `unknown` tokens."""
    from data_pipelines.readers import read_documents
    from titanloop.data.shard_format import ShardWriter, token_dtype
    from titanloop.data.tokenizer import load_tokenizer

    part, path, args, fingerprint, eos_id, vocab_size, unk_id, train_chars, progress = job
    progress = progress or _worker_progress
    counts = {"null": 0, "short": 0, "unknown": 0, "unknown_docs": 0}
    try:
        tokenizer = load_tokenizer(args.tokenizer)
        dtype = token_dtype(vocab_size)
        writers = {"train": ShardWriter(args.format, args.local_out, part, dtype, fingerprint, args.shard_bytes)}
        docs = tokens = 0
        batch: list[tuple[str, str, dict, str]] = []
        offset = 0  # characters of this file's documents so far

        def writer(split: str):
            if split not in writers:  # the held-out part exists only for files that reach past the split
                writers[split] = ShardWriter(
                    args.format, args.local_holdout, part, dtype, fingerprint, args.shard_bytes
                )
            return writers[split]

        def flush():
            nonlocal docs, tokens
            encodings = tokenizer.encode_batch([text for text, _, _, _ in batch], add_special_tokens=False)
            n_tok = 0
            for (_, doc_id, meta, split), enc in zip(batch, encodings):
                ids = enc.ids
                if len(ids) < args.min_tokens:
                    counts["short"] += 1
                    continue
                if unk_id is not None:
                    unknown = ids.count(unk_id)
                    counts["unknown"] += unknown
                    counts["unknown_docs"] += unknown > 0
                writer(split).write(ids + [eos_id], doc_id, 0, meta)
                docs += 1
                n_tok += len(ids) + 1
            tokens += n_tok
            progress.put((0, n_tok))
            batch.clear()

        for text, doc_id, meta in read_documents(path, args.text_column, args.text_split):
            if text is None:  # a null text: dropped, and counted
                counts["null"] += 1
                continue
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
    except Exception as e:
        raise _input_error(path, e, args.debug) from None
    progress.put((1, 0))
    return part, shards, docs, tokens, held, counts


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


def _run_pool(args, jobs: list, paths: list[str], sink: _Progress | None, fn=None) -> list:
    """Run `fn` (default tokenize_file) over `jobs` (one per input file, `paths`) in worker processes.

    A worker's error comes back as an exception (InputError, never SystemExit, which would kill the worker and
    leave its task unanswered); the first one tears the pool down and is raised here. A worker that dies (killed,
    out of memory) is noticed too: each job reports its worker's pid when it starts. Fork is used only from a
    single-threaded process (forking while other threads hold locks can deadlock the child); otherwise spawn."""
    ctx = mp.get_context("fork" if threading.active_count() == 1 else "spawn")
    progress = ctx.SimpleQueue()  # put() writes to the pipe at once: a worker that dies next has still reported
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    pool = ctx.Pool(min(args.workers, len(jobs)), initializer=_init_worker, initargs=(progress,))
    try:
        pending = [pool.apply_async(_pooled, (fn or tokenize_file, i, job)) for i, job in enumerate(jobs)]
        started: dict[int, int] = {}  # job -> pid of the worker running it
        while True:
            if progress.empty():
                time.sleep(0.1)
            while not progress.empty():
                item = progress.get()
                if item[0] == "start":
                    started[item[1]] = item[2]
                elif sink is not None:
                    sink.put(item)
            for r in pending:
                if r.ready() and not r.successful():
                    r.get()  # raises the worker's error
            if all(r.ready() for r in pending) and progress.empty():
                break
            for i, pid in started.items():
                if not pending[i].ready() and not _alive(pid):
                    raise InputError(
                        f"input {paths[i]}: the worker process tokenizing it died (killed, or out of memory?); "
                        "run again with fewer --workers"
                    )
        return [r.get() for r in pending]
    finally:
        pool.terminate()
        pool.join()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _pooled(fn, i: int, job):
    """In a worker: say which process runs job `i`, then run it."""
    _worker_progress.put(("start", i, os.getpid()))
    try:
        return fn(job)
    except (SystemExit, KeyboardInterrupt) as e:  # never let a worker die with its task unanswered
        raise InputError(str(e.code) if isinstance(e, SystemExit) else "interrupted") from None


_worker_progress = None


def _init_worker(progress) -> None:
    global _worker_progress
    _worker_progress = progress


def _unk_id(tokenizer) -> int | None:
    """The id of the tokenizer model's unknown token, if it has one (WordLevel, WordPiece, BPE, Unigram)."""
    import json

    model = json.loads(tokenizer.to_str()).get("model", {})
    if model.get("unk_token") is not None:
        return tokenizer.token_to_id(model["unk_token"])
    if isinstance(model.get("unk_id"), int):
        return model["unk_id"]
    return None


def main(argv=None) -> None:
    args = parse_args(argv)  # heavy imports only after --help / argument errors
    with errors_as_one_line(args.debug):
        run(args)


def run(args: argparse.Namespace) -> None:
    from titanloop.data.shard_output import OutputDir
    from data_pipelines.readers import list_inputs
    from titanloop.data.shard_format import Manifest, token_dtype
    from titanloop.data.tokenizer import load_tokenizer, tokenizer_record

    args.debug = debug_enabled(args.debug)
    # every check before any data is read or anything is written
    out = OutputDir(args.out, args.overwrite, "--out", prepare=False)
    holdout = OutputDir(args.holdout_out, args.overwrite, "--holdout-out", prepare=False) if args.holdout_out else None
    tok = tokenizer_record(args.tokenizer, args.eos_token)
    fingerprint, eos_id, vocab_size = tok["fingerprint"], tok["eos_id"], tok["vocab_size"]
    unk_id = _unk_id(load_tokenizer(args.tokenizer))
    inputs = list_inputs(args.inputs)
    if not inputs:
        raise InputError(f"no parquet / jsonl(.zst) / txt files found in {args.inputs}")
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
    total_chars = None
    if holdout is not None:
        print(f"counting characters for the held-out split ({args.holdout:g} of the corpus)", file=sys.stderr)
        jobs = [(path, args) for path in inputs]
        counts = [count_chars(j) for j in jobs] if in_process else _run_pool(args, jobs, inputs, None, count_chars)
        total_chars = sum(counts)
        keep = int((1 - args.holdout) * total_chars)
        before = [sum(counts[:i]) for i in range(len(counts))]
        train_chars = [min(max(keep - b, 0), c) for b, c in zip(before, counts)]
    targets = [t for t in (out, holdout) if t is not None]
    bar = None
    try:
        for t in targets:
            t.prepare()
        args.local_out, args.local_holdout = out.local, holdout.local if holdout else None
        bar = tqdm(
            total=None,
            unit="tok",
            unit_scale=True,
            desc=f"{source} 0/{len(inputs)} files",
            file=sys.stderr,
            mininterval=0.5,
        )
        jobs = [
            (i, path, args, fingerprint, eos_id, vocab_size, unk_id, train_chars[i]) for i, path in enumerate(inputs)
        ]
        if in_process:
            progress = _Progress(bar, len(inputs), source)
            results = [tokenize_file((*job, progress)) for job in jobs]
        else:
            results = _run_pool(args, [(*job, None) for job in jobs], inputs, _Progress(bar, len(inputs), source))
        bar.close()
        secs = time.time() - start
        results = sorted(results, key=lambda r: r[0])
        counts = {k: sum(r[5][k] for r in results) for k in results[0][5]}
        sets = [(out, args.out, "--out", source, 1)]
        if holdout:
            sets.append((holdout, args.holdout_out, "--holdout-out", f"{source}-holdout", 4))
        manifests = []
        for target, where, flag, name, column in sets:
            manifest = Manifest(
                format=args.format, source=name, dtype=token_dtype(vocab_size), tokenizer=tok, inputs=inputs
            )
            for r in results:
                manifest.shards += r[column]
            manifests.append(manifest)
            if manifest.tokens == 0:
                raise InputError(_empty(args, flag, total_chars, counts))
        for (target, where, *_), manifest in zip(sets, manifests):
            target.publish(manifest)
            print(
                f"wrote {manifest.documents} documents, {manifest.tokens} tokens in {len(manifest.shards)} shards to "
                f"{where} ({manifest.tokens / max(secs, 1e-9):,.0f} tokens/s)",
                file=sys.stderr,
            )
    except BaseException as e:
        if bar is not None:
            bar.close()  # before the error line, which is the last line
        hints = [h for h in (t.discard() for t in targets) if h]
        if hints and isinstance(e, Exception) and not args.debug:
            from data_pipelines.cli import one_line

            raise InputError(f"{one_line(e)}; {'; '.join(hints)}") from None
        raise
    print(_report(args, counts), file=sys.stderr)
    if counts["unknown"]:
        print(
            f"warning: {counts['unknown']} unknown tokens in {counts['unknown_docs']} documents: the tokenizer lacks "
            "characters of these inputs; build it from them (data_pipelines.tokenizer) to keep them",
            file=sys.stderr,
        )


def _report(args, counts: dict) -> str:
    dropped = counts["null"] + counts["short"]
    return (
        f"dropped {dropped} documents ({counts['null']} with a null text, {counts['short']} with fewer than "
        f"--min-tokens {args.min_tokens} tokens); {counts['unknown']} unknown tokens"
    )


def _empty(args, flag: str, total_chars: int | None, counts: dict) -> str:
    """Why a set would hold no tokens, and what to do."""
    if total_chars is not None and total_chars > 0:
        more = "lower" if flag == "--out" else "raise"
        return (
            f"--holdout {args.holdout:g} leaves {flag} {getattr(args, flag[2:].replace('-', '_'))} with 0 tokens "
            f"(the inputs hold {total_chars} characters); {more} --holdout; nothing was written"
        )
    return (
        f"the inputs {args.inputs} hold no text to tokenize ({_report(args, counts)}); "
        "pass a non-empty corpus; nothing was written"
    )


if __name__ == "__main__":
    main()
