"""Print statistics of shard sets: documents, tokens, tokens per source, shards, bytes, tokenizer.

    python -m data_pipelines.stats /data/shards/fineweb-edu /data/shards/nemotron [--verify] [--json out.json]

Reads only the manifests unless --verify, which reads every shard and its index, checks their sha1, the
document and token counts against the manifest and the index against the shard, and exits nonzero naming the
first bad shard.
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m data_pipelines.stats", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("paths", nargs="+", help="shard-set directories or URLs (each holds manifest.json)")
    p.add_argument("--verify", action="store_true", help="read and check every shard")
    p.add_argument("--json", default=None, help="also write the statistics as JSON to this file")
    a = p.parse_args(argv)

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
        with open(a.json, "w") as f:
            json.dump({"sets": rows, "documents": total_docs, "tokens": total_tokens}, f, indent=1)


if __name__ == "__main__":
    main()
