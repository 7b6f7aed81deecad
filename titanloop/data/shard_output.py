"""Shard-set output directories: refuse to clobber, stage remote outputs locally, publish the manifest last.

An existing non-empty output (a local directory, or objects under a remote prefix) is refused unless
`overwrite`; then a local one may hold only a shard set's own entries (manifest.json, index.json, part-*), which
are removed before writing, and a remote one is written over (objects of the same name are replaced; the new
manifest names only the new shards). The manifest is written (atomically, then uploaded) only after every shard
exists, so a reader never sees a manifest that names shards which are not there yet. `discard()` removes what
a failed run wrote, so a rerun is not blocked.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import tempfile

from titanloop.config_errors import ConfigError
from titanloop.data.shard_format import DEFAULT_SHARD_BYTES, MANIFEST, Manifest, ShardWriter, token_dtype
from titanloop.data.shards import ShardFetcher, is_remote

SHARD_SET_ENTRIES = (MANIFEST, MANIFEST + ".tmp", "index.json", "part-*")  # what a shard-set writer creates


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.remove(path)


def _is_own(name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in SHARD_SET_ENTRIES)


def remote_objects(url: str, limit: int = 3) -> list[str]:
    """Up to `limit` object names under a remote prefix (s3:// through boto3, other schemes through pyarrow)."""
    url = url.rstrip("/")
    if url.startswith("s3://"):
        bucket, _, prefix = url.removeprefix("s3://").partition("/")
        listing = (
            ShardFetcher(url)
            .client()
            .list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/" if prefix else "", MaxKeys=limit)
        )
        return [f"s3://{bucket}/{o['Key']}" for o in listing.get("Contents", [])]
    import pyarrow.fs as pafs

    fs, inner = pafs.FileSystem.from_uri(url)
    infos = fs.get_file_info(pafs.FileSelector(inner, recursive=True, allow_not_found=True))
    return [i.path for i in infos if i.type == pafs.FileType.File][:limit]


class OutputDir:
    """Where one shard set is written. `flag` names the option in error messages; with `prepare=False` only the
    checks run, and `prepare()` (removing an overwritten set, creating the directory) comes later."""

    def __init__(self, out: str, overwrite: bool = False, flag: str = "--out", prepare: bool = True):
        self.out = out.rstrip("/")
        self.flag, self.overwrite = flag, overwrite
        self.remote = is_remote(out)
        self.local = None if self.remote else self.out.removeprefix("file://") or "/"
        self.created = self.uploading = False
        self._check()
        if prepare:
            self.prepare()

    def _check(self) -> None:
        again = "choose a new directory, or pass --overwrite to replace the shard set"
        if self.remote:
            try:
                found = remote_objects(self.out)
            except Exception as e:  # noqa: BLE001 - a missing bucket, refused credentials, ... as one line
                raise ConfigError(f"{self.flag} {self.out} cannot be listed ({type(e).__name__}: {e})") from None
            if found and not self.overwrite:
                raise ConfigError(f"{self.flag} {self.out} already holds objects (e.g. {found[0]}); {again}")
            return
        if os.path.exists(self.local) and not os.path.isdir(self.local):
            raise ConfigError(f"{self.flag} {self.out} is a file: give a directory (new or empty)")
        parent = os.path.dirname(os.path.abspath(self.local))
        while not os.path.exists(parent):
            parent = os.path.dirname(parent)
        if not os.path.isdir(parent):
            raise ConfigError(f"{self.flag} {self.out}: {parent} is a file, not a directory; choose another path")
        entries = sorted(os.listdir(self.local)) if os.path.isdir(self.local) else []
        if entries and not self.overwrite:
            raise ConfigError(
                f"{self.flag} {self.out} is not empty (holds {entries[0]}); {again} (existing shards are never "
                "overwritten otherwise)"
            )
        foreign = [e for e in entries if not _is_own(e)]
        if foreign:
            raise ConfigError(
                f"{self.flag} {self.out} holds {foreign[0]}, which is not part of a shard set: --overwrite replaces "
                "only a shard set; choose a new directory"
            )

    def prepare(self) -> None:
        if self.remote:
            self.local = tempfile.mkdtemp(prefix="titanloop-shards-")
            return
        if os.path.isdir(self.local):
            for entry in os.listdir(self.local):  # only a shard set's entries are left after _check
                _remove(os.path.join(self.local, entry))
        else:
            os.makedirs(self.local)
            self.created = True

    def discard(self) -> str | None:
        """Remove what this run wrote (after a failure). Returns None, or a hint naming what to remove by hand."""
        if self.local is None or not os.path.isdir(self.local):
            return None
        try:
            if self.remote or self.created:
                shutil.rmtree(self.local)
            else:
                for entry in os.listdir(self.local):
                    if _is_own(entry):
                        _remove(os.path.join(self.local, entry))
        except OSError:
            return f"remove {self.local} before running again"
        if self.uploading:
            return f"objects already uploaded under {self.out} stay: run again with --overwrite"
        return None

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

        self.uploading = True
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
    target: OutputDir | None = None,
) -> Manifest:
    """Write an iterable of (tokens, id, prompt_len, meta) documents as one shard set (single part).

    Used for generated data (synthetic tasks, benchmarks, tests); corpora go through data_pipelines.tokenize.
    """
    target = target or OutputDir(out)
    dtype = token_dtype(int(tokenizer["vocab_size"]))
    writer = ShardWriter(fmt, target.local, 0, dtype, tokenizer["fingerprint"], shard_bytes)
    try:
        for tokens, doc_id, prompt_len, meta in documents:
            writer.write(tokens, doc_id, prompt_len, meta)
        manifest = Manifest(
            format=fmt,
            source=source,
            tokenizer=dict(tokenizer),
            dtype=dtype,
            shards=writer.finish(),
            inputs=inputs or [],
        )
        target.publish(manifest)
    except BaseException:
        target.discard()
        raise
    return manifest
