"""Make a shard set written by mosaicml-streaming's MDSWriter or webdataset's TarWriter readable by titanloop.

    python -m data_pipelines.manifest /data/their-mds --format mds --tokenizer tokenizer.json [--source name]

The shards must hold pre-tokenized documents: MDS column / tar member `tokens` (raw little-endian token ids,
uint16 if the tokenizer's vocabulary fits, else uint32, each document ending with EOS); `id` (MDS str) and
`prompt_len` (MDS int) or a `.json` member with {"id", "prompt_len"} are optional. Every shard is read once:
its documents and tokens are counted, its index (`<shard>.idx`) is written beside it and manifest.json last.
MDS sets are listed by their top-level index.json (or one per part-*/ directory); tar sets by *.tar files.
A directory that already has a manifest.json is refused. Errors are one line (--debug shows the traceback).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

from data_pipelines.cli import InputError, add_debug_flag, errors_as_one_line


def list_shards(root: str, fmt: str) -> list[str]:
    if fmt == "webdataset":
        return sorted(os.path.relpath(p, root) for p in glob.glob(os.path.join(root, "**", "*.tar"), recursive=True))
    indexes = (
        [os.path.join(root, "index.json")]
        if os.path.isfile(os.path.join(root, "index.json"))
        else sorted(glob.glob(os.path.join(root, "*", "index.json")))
    )
    shards = []
    for path in indexes:
        with open(path) as f:
            try:
                listed = json.load(f)["shards"]
            except (ValueError, KeyError, TypeError) as e:
                raise InputError(f"{path} is not an MDS index.json ({type(e).__name__}: {e})") from None
            for shard in listed:
                if shard.get("compression"):
                    raise SystemExit(
                        f"error: {path}: shard {shard['raw_data']['basename']} is compressed "
                        f"({shard['compression']}); write the set with compression=None"
                    )
                rel = os.path.relpath(os.path.join(os.path.dirname(path), shard["raw_data"]["basename"]), root)
                shards.append(rel)
    return shards


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m data_pipelines.manifest",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("root", help="local directory of the shard set")
    p.add_argument("--format", choices=("mds", "webdataset"), required=True)
    p.add_argument("--tokenizer", required=True, help="tokenizer.json the tokens were produced with")
    p.add_argument("--source", default=None, help="source name (default: the directory name)")
    p.add_argument("--eos-token", default=None, help="EOS token (default: found in the vocabulary)")
    add_debug_flag(p)
    a = p.parse_args(argv)
    with errors_as_one_line(a.debug):
        run(a)


def run(a: argparse.Namespace) -> None:
    if not os.path.isdir(a.root):
        raise InputError(f"{a.root} is not a directory: pass the local directory of an MDS or webdataset shard set")

    from titanloop.config_errors import ConfigError
    from titanloop.data.errors import ShardError
    from titanloop.data.shard_format import (
        INDEX_SUFFIX,
        MANIFEST,
        Manifest,
        ShardInfo,
        build_index,
        decode_shard,
        sha1_bytes,
        token_dtype,
    )
    from titanloop.data.tokenizer import tokenizer_record

    if os.path.exists(os.path.join(a.root, MANIFEST)):
        raise SystemExit(f"error: {os.path.join(a.root, MANIFEST)} exists; this set is already readable")
    try:
        tok = tokenizer_record(a.tokenizer, a.eos_token)
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
    fingerprint, dtype = tok["fingerprint"], token_dtype(tok["vocab_size"])
    shards = list_shards(a.root, a.format)
    if not shards:
        raise SystemExit(f"error: no {a.format} shards found in {a.root}")
    infos = []
    try:
        for rel in shards:
            with open(os.path.join(a.root, rel), "rb") as f:
                data = f.read()
            shard = decode_shard(a.format, data, dtype, rel)
            index = build_index(a.format, data, dtype, rel)
            with open(os.path.join(a.root, rel + INDEX_SUFFIX), "wb") as f:
                f.write(index)
            infos.append(
                ShardInfo(
                    rel,
                    len(shard.doc_starts) - 1,
                    len(shard.tokens),
                    len(data),
                    sha1_bytes(data),
                    fingerprint,
                    rel + INDEX_SUFFIX,
                    len(index),
                    sha1_bytes(index),
                )
            )
    except ShardError as e:
        raise SystemExit(f"error: {e}") from None
    manifest = Manifest(
        format=a.format,
        source=a.source or os.path.basename(os.path.abspath(a.root)),
        dtype=dtype,
        tokenizer=tok,
        shards=infos,
    )
    with open(os.path.join(a.root, MANIFEST), "w") as f:
        f.write(manifest.to_json())
    print(
        f"{a.root}: {manifest.documents} documents, {manifest.tokens} tokens in {len(infos)} shards; wrote "
        f"{MANIFEST} and {len(infos)} indexes",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
