"""Shard-set output directories: refuse to clobber, stage remote outputs locally, publish the manifest last.

The manifest is written (atomically, then uploaded) only after every shard exists, so a reader never sees
a manifest that names shards which are not there yet.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

from titanloop.data.shard_format import DEFAULT_SHARD_BYTES, MANIFEST, Manifest, ShardWriter, token_dtype


class OutputDir:
    def __init__(self, out: str):
        self.out = out.rstrip("/")
        self.remote = "://" in out and not out.startswith("file://")
        if self.remote:
            self.local = tempfile.mkdtemp(prefix="titanloop-shards-")
        else:
            self.local = out.removeprefix("file://")
            if os.path.isdir(self.local) and os.listdir(self.local):
                raise SystemExit(
                    f"error: --out {out} is not empty; choose a new directory (existing shards are never overwritten)"
                )
            os.makedirs(self.local, exist_ok=True)

    def publish(self, manifest: Manifest) -> None:
        if manifest.format == "mds":
            self._merge_mds_index()
        tmp = os.path.join(self.local, MANIFEST + ".tmp")
        with open(tmp, "w") as f:
            f.write(manifest.to_json())
        os.replace(tmp, os.path.join(self.local, MANIFEST))
        if self.remote:
            self._upload(manifest)

    def _merge_mds_index(self) -> None:
        """Top-level MDS index.json over all parts (what streaming.base.util.merge_index writes), so
        `streaming.StreamingDataset(local=<out>)` reads the whole set."""
        shards = []
        for part in sorted(d for d in os.listdir(self.local) if d.startswith("part-")):
            with open(os.path.join(self.local, part, "index.json")) as f:
                for shard in json.load(f)["shards"]:
                    for key in ("raw_data", "zip_data"):
                        if shard.get(key):
                            shard[key]["basename"] = f"{part}/{shard[key]['basename']}"
                    shards.append(shard)
        with open(os.path.join(self.local, "index.json"), "w") as f:
            json.dump({"version": 2, "shards": shards}, f, sort_keys=True)

    def _upload(self, manifest: Manifest) -> None:
        from streaming.base.storage import CloudUploader

        uploader = CloudUploader.get((self.local, self.out), keep_local=False, exist_ok=True)
        files = [s.path for s in manifest.shards] + [s.index for s in manifest.shards if s.index]
        if manifest.format == "mds":
            files += sorted({os.path.dirname(s.path) + "/index.json" for s in manifest.shards}) + ["index.json"]
        for rel in files + [MANIFEST]:  # manifest last
            uploader.upload_file(rel)
        shutil.rmtree(self.local, ignore_errors=True)


def write_shard_set(
    out: str,
    fmt: str,
    source: str,
    documents,
    tokenizer: dict,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    inputs: list[str] | None = None,
) -> Manifest:
    """Write an iterable of (tokens, id, prompt_len, meta) documents as one shard set (single part).

    Used for generated data (synthetic tasks, benchmarks, tests); corpora go through data_pipelines.tokenize.
    """
    target = OutputDir(out)
    dtype = token_dtype(int(tokenizer["vocab_size"]))
    writer = ShardWriter(fmt, target.local, 0, dtype, tokenizer["fingerprint"], shard_bytes)
    for tokens, doc_id, prompt_len, meta in documents:
        writer.write(tokens, doc_id, prompt_len, meta)
    manifest = Manifest(
        format=fmt, source=source, tokenizer=dict(tokenizer), dtype=dtype, shards=writer.finish(), inputs=inputs or []
    )
    target.publish(manifest)
    return manifest
