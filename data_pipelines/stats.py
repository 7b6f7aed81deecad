"""Print statistics of shard sets: documents, tokens, tokens per source, shards, bytes, tokenizer.

    python -m data_pipelines.stats /data/shards/fineweb-edu /data/shards/nemotron [--verify] [--json out.json]

Reads only the manifests unless --verify, which reads every shard and its index, checks their sha1, the
document and token counts against the manifest and the index against the shard, and exits nonzero naming the
first bad shard. --json must name a new file (or pass --overwrite); a shard set's manifest.json is never written.
Errors are one line (--debug, or TITANLOOP_DEBUG=1, shows the traceback).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from data_pipelines.cli import (
    InputError,
    add_debug_flag,
    check_new_file,
    errors_as_one_line,
    is_remote,
    resolved,
    write_text_atomically,
)


def _check_json_target(path: str, sets: list[str], overwrite: bool) -> None:
    """--json: a new file (or one --overwrite replaces), never a shard set's manifest."""
    from titanloop.data.shard_format import MANIFEST

    manifests = {resolved(os.path.join(s, MANIFEST)) for s in sets if not is_remote(s)}
    looks_like_manifest = False
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                obj = json.load(f)
            looks_like_manifest = isinstance(obj, dict) and "shards" in obj and "tokenizer" in obj
        except (OSError, ValueError):
            pass
    if resolved(path) in manifests or looks_like_manifest:
        raise InputError(f"--json {path} is a shard set's manifest: it is never overwritten; choose another file")
    check_new_file(path, "--json", overwrite)


def _check_sets(paths: list[str]) -> None:
    from titanloop.data.shard_format import MANIFEST

    for path in paths:
        if is_remote(path):
            continue
        local = path.removeprefix("file://")
        if os.path.isfile(local):
            parent = os.path.dirname(path) or "."
            raise InputError(f"{path} is a file: pass a shard-set directory (it holds {MANIFEST}), e.g. {parent}")
        if not os.path.exists(local):
            raise InputError(f"{path} does not exist: pass a shard-set directory (it holds {MANIFEST})")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m data_pipelines.stats", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("paths", nargs="+", help="shard-set directories or URLs (each holds manifest.json)")
    p.add_argument("--verify", action="store_true", help="read and check every shard")
    p.add_argument("--json", default=None, help="also write the statistics as JSON to this new file")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --json file")
    add_debug_flag(p)
    a = p.parse_args(argv)
    with errors_as_one_line(a.debug):
        run(a)


def run(a: argparse.Namespace) -> None:
    _check_sets(a.paths)
    if a.json:
        _check_json_target(a.json, a.paths, a.overwrite)

    from titanloop.data.errors import ShardError
    from titanloop.data.shard_format import build_index, decode_shard, sha1_bytes
    from titanloop.data.shards import ShardFetcher, read_manifest

    rows, total_docs, total_tokens = [], 0, 0
    for path in a.paths:
        try:
            m = read_manifest(path)
            if a.verify:
                fetcher = ShardFetcher(path, None)
                for info in m.shards:
                    where = fetcher.location(info.path)
                    data = fetcher.read(info.path)
                    if len(data) != info.bytes or sha1_bytes(data) != info.sha1:
                        raise ShardError(where, "size or sha1 differs from the manifest: corrupt or truncated")
                    shard = decode_shard(m.format, data, m.dtype, where)
                    if len(shard.doc_starts) - 1 != info.documents or len(shard.tokens) != info.tokens:
                        raise ShardError(where, "document or token count differs from the manifest")
                    if info.index:
                        index = fetcher.read(info.index)
                        if sha1_bytes(index) != info.index_sha1 or index != build_index(m.format, data, m.dtype, where):
                            raise ShardError(
                                fetcher.location(info.index),
                                "differs from its shard or the manifest",
                                "re-create the shard set",
                            )
        except ShardError as e:
            raise SystemExit(f"error: {e}") from None
        except ValueError as e:  # a manifest that is not JSON / not a manifest
            raise InputError(f"{path}: the manifest cannot be read ({e}); re-create the shard set") from None
        rows.append(
            {
                "path": path,
                "source": m.source,
                "format": m.format,
                "documents": m.documents,
                "tokens": m.tokens,
                "shards": len(m.shards),
                "bytes": sum(s.bytes for s in m.shards),
                "tokenizer": m.tokenizer.get("fingerprint"),
                "verified": a.verify,
            }
        )
        total_docs += m.documents
        total_tokens += m.tokens

    header = f"{'source':<20} {'format':<10} {'shards':>7} {'documents':>12} {'tokens':>15} {'share':>7}  tokenizer"
    print(header)
    print("-" * len(header))
    for r in rows:
        share = r["tokens"] / max(total_tokens, 1)
        print(
            f"{r['source']:<20} {r['format']:<10} {r['shards']:>7} {r['documents']:>12,} {r['tokens']:>15,} "
            f"{share:>7.1%}  {r['tokenizer'][:17]}"
        )
    print(f"{'total':<20} {'':<10} {sum(r['shards'] for r in rows):>7} {total_docs:>12,} {total_tokens:>15,}")
    if a.verify:
        print("all shards verified (sha1, documents, tokens, index)", file=sys.stderr)
    if a.json:
        write_text_atomically(
            a.json, json.dumps({"sets": rows, "documents": total_docs, "tokens": total_tokens}, indent=1)
        )


if __name__ == "__main__":
    main()
