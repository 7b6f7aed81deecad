"""Shard sets as packed-row sources: random access to fixed-length windows of a source's token stream.

A source's token stream is its documents back to back in manifest order (each ends with EOS). Row k of
epoch e = k // W (W = (tokens - 1) // seq_len windows per epoch) is window w of that stream, tokens
[w*seq_len, w*seq_len + seq_len + 1): consecutive windows overlap by one token so every token is a target
exactly once per epoch. Windows are shuffled within blocks of `shuffle_block` (a permutation seeded by
(seed, source, epoch, block)), which keeps reads local (a few shards in memory) while mixing documents.

Checks, all failing with one line naming the shard (ShardError) or the field (ConfigError):
manifest format vs data.kind, tokenizer fingerprint vs data.tokenizer (and across sources), vocabulary
vs the model's vocab_size, missing or wrong-size files at startup (local sets), sha1 and document/token
counts when a shard is first read. With on_bad_shard="skip", rows touching a bad shard come out fully
masked (labels all -100), a warning names the shard once and `bad_rows` counts them.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections import OrderedDict

import numpy as np

from titanloop.config_errors import ConfigError, require
from titanloop.data.config import DataConfig, SourceConfig
from titanloop.data.errors import ShardError
from titanloop.data.packing import PackedRow
from titanloop.data.shard_format import MANIFEST, Manifest, ShardData, decode_shard, sha1_bytes
from titanloop.data.tokenizer import tokenizer_fingerprint

log = logging.getLogger(__name__)


def is_remote(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


class ShardFetcher:
    """Reads files of a shard set: directly for local paths, via mosaicml-streaming's downloaders for URLs."""

    def __init__(self, root: str, cache_dir: str | None):
        self.root = root.removeprefix("file://").rstrip("/")
        self.remote = is_remote(root)
        if self.remote:
            base = cache_dir or os.path.join(tempfile.gettempdir(), "titanloop-shard-cache")
            self.cache = os.path.join(base, hashlib.sha1(self.root.encode()).hexdigest()[:16])

    def location(self, rel: str) -> str:
        return f"{self.root}/{rel}"

    def local_path(self, rel: str) -> str:
        if not self.remote:
            return os.path.join(self.root, rel)
        from streaming.base.storage import CloudDownloader

        local = os.path.join(self.cache, rel)
        try:
            CloudDownloader.direct_download(self.location(rel), local)
        except Exception as e:
            raise ShardError(self.location(rel), f"download failed ({type(e).__name__}: {e})",
                             "check the URL and credentials") from None
        return local

    def read(self, rel: str) -> bytes:
        path = self.local_path(rel)
        try:
            with open(path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            raise ShardError(self.location(rel), "missing", "restore it or re-create the shard set") from None


def read_manifest(root: str, cache_dir: str | None = None) -> Manifest:
    fetcher = ShardFetcher(root, cache_dir)
    where = fetcher.location(MANIFEST)
    try:
        text = fetcher.read(MANIFEST).decode("utf-8")
    except ShardError:
        raise ShardError(where, "missing", "point data.sources[].path at a directory written by "
                                              "data_pipelines (it holds manifest.json)") from None
    return Manifest.from_json(text, where)


class ShardSource:
    """Packed rows of one shard set (see the module docstring)."""

    def __init__(self, src: SourceConfig, cfg: DataConfig, seq_len: int, vocab_size: int,
                 expected_fingerprint: str | None):
        self.fetcher = ShardFetcher(src.path, cfg.cache_dir)
        self.manifest = m = read_manifest(src.path, cfg.cache_dir)
        self.name = src.name or m.source
        self.seq_len, self.seed = seq_len, cfg.seed
        self.block = int(cfg.shuffle_block)
        self.on_bad_shard, self.verify = cfg.on_bad_shard, cfg.verify_checksums
        require(m.format == cfg.kind, "data.kind", cfg.kind,
                f"{m.format!r}: the shard set {src.path} is in {m.format} format")
        fp = m.tokenizer.get("fingerprint")
        if expected_fingerprint is not None and fp != expected_fingerprint:
            raise ShardError(self.fetcher.location(MANIFEST), f"was written with tokenizer {fp}, "
                             f"data.tokenizer={cfg.tokenizer} is {expected_fingerprint}",
                             "re-tokenize the source or configure the tokenizer it was written with")
        require(int(m.tokenizer.get("vocab_size", 0)) <= vocab_size, "vocab_size", vocab_size,
                f">= {m.tokenizer.get('vocab_size')}, the vocabulary of shard set {src.path}")
        self.bad_shards: set[int] = set()
        self.bad_rows = 0
        for i, shard in enumerate(m.shards):
            if shard.tokenizer != fp:
                self._bad(i, f"was written with tokenizer {shard.tokenizer}, its manifest says {fp}",
                          "remove it from the manifest or re-tokenize it")
            elif not self.fetcher.remote:
                path = os.path.join(self.fetcher.root, shard.path)
                if not os.path.isfile(path):
                    self._bad(i, "missing", "restore it or re-create the shard set")
                elif os.path.getsize(path) != shard.bytes:
                    self._bad(i, f"has {os.path.getsize(path)} bytes, the manifest says {shard.bytes}: "
                                 "truncated or corrupt")
        self.token_offsets = np.concatenate([[0], np.cumsum([s.tokens for s in m.shards])]).astype(np.int64)
        self.doc_offsets = np.concatenate([[0], np.cumsum([s.documents for s in m.shards])]).astype(np.int64)
        self.windows = (int(self.token_offsets[-1]) - 1) // seq_len
        require(self.windows >= 1, "seq_len", seq_len,
                f"< {int(self.token_offsets[-1])} tokens, the size of shard set {src.path}")
        self.vocab_size = vocab_size
        self.eos_id = int(m.tokenizer.get("eos_id", 0))
        self._key = int(hashlib.sha1(self.name.encode()).hexdigest()[:8], 16)
        self._cache: OrderedDict[int, ShardData] = OrderedDict()
        self._cache_size = int(cfg.shard_cache)
        self._perm: tuple[tuple[int, int], np.ndarray] | None = None

    def epoch_of(self, samples: int) -> int:
        return samples // self.windows

    # ----- bad shards ---------------------------------------------------------------------------
    def _bad(self, i: int, problem: str, fix: str = "re-create it with data_pipelines.tokenize"):
        err = ShardError(self.fetcher.location(self.manifest.shards[i].path), problem, fix)
        if self.on_bad_shard == "error":
            raise err
        if i not in self.bad_shards:
            log.warning("skipping bad shard (data.on_bad_shard='skip'): %s", err)
            self.bad_shards.add(i)

    def _load(self, i: int) -> ShardData | None:
        if i in self._cache:
            self._cache.move_to_end(i)
            return self._cache[i]
        if i in self.bad_shards:
            return None
        info = self.manifest.shards[i]
        where = self.fetcher.location(info.path)
        try:
            data = self.fetcher.read(info.path)
            if len(data) != info.bytes:
                raise ShardError(where, f"has {len(data)} bytes, the manifest says {info.bytes}: truncated or corrupt")
            if self.verify and sha1_bytes(data) != info.sha1:
                raise ShardError(where, "sha1 differs from the manifest: corrupt or replaced")
            shard = decode_shard(self.manifest.format, data, self.manifest.dtype, where)
            if len(shard.doc_starts) - 1 != info.documents or len(shard.tokens) != info.tokens:
                raise ShardError(where, f"holds {len(shard.doc_starts) - 1} documents / {len(shard.tokens)} tokens, "
                                        f"the manifest says {info.documents} / {info.tokens}")
            if len(shard.tokens) and int(shard.tokens.max()) >= self.vocab_size:
                raise ShardError(where, f"has token id {int(shard.tokens.max())} >= vocab_size={self.vocab_size}")
        except ShardError as e:
            if self.on_bad_shard == "error":
                raise
            log.warning("skipping bad shard (data.on_bad_shard='skip'): %s", e)
            self.bad_shards.add(i)
            return None
        self._cache[i] = shard
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return shard

    # ----- rows ---------------------------------------------------------------------------------
    def _window(self, epoch: int, i: int) -> int:
        block, pos = divmod(i, self.block)
        if self._perm is None or self._perm[0] != (epoch, block):
            size = min(self.block, self.windows - block * self.block)
            perm = np.random.default_rng([self.seed, self._key, epoch, block]).permutation(size)
            self._perm = ((epoch, block), perm)
        return block * self.block + int(self._perm[1][pos])

    def row(self, k: int) -> PackedRow:
        epoch, i = divmod(k, self.windows)
        start = self._window(epoch, i) * self.seq_len
        stop = start + self.seq_len + 1
        tokens, doc_ids, targets = [], [], []
        first = int(np.searchsorted(self.token_offsets, start, side="right")) - 1
        last = int(np.searchsorted(self.token_offsets, stop - 1, side="right")) - 1
        for s in range(first, last + 1):
            shard = self._load(s)
            if shard is None:
                self.bad_rows += 1
                n = self.seq_len + 1
                return PackedRow(np.full(n, self.eos_id, np.int64), np.zeros(n, np.int64), np.zeros(n, bool))
            lo = max(start, int(self.token_offsets[s])) - int(self.token_offsets[s])
            hi = min(stop, int(self.token_offsets[s + 1])) - int(self.token_offsets[s])
            pos = np.arange(lo, hi)
            local_doc = np.searchsorted(shard.doc_starts, pos, side="right") - 1
            tokens.append(shard.tokens[lo:hi].astype(np.int64))
            doc_ids.append(local_doc + int(self.doc_offsets[s]))
            targets.append(pos - shard.doc_starts[local_doc] >= shard.prompt_lens[local_doc])
        return PackedRow(np.concatenate(tokens), np.concatenate(doc_ids), np.concatenate(targets))


def open_shard_sources(cfg: DataConfig, *, seq_len: int, vocab_size: int) -> list[ShardSource]:
    expected = tokenizer_fingerprint(cfg.tokenizer) if cfg.tokenizer else None
    sources = [ShardSource(s, cfg, seq_len, vocab_size, expected) for s in cfg.sources]
    fps = {s.manifest.tokenizer.get("fingerprint") for s in sources}
    if len(fps) > 1:
        raise ConfigError(f"data.sources were written with different tokenizers {sorted(fps)}: re-tokenize "
                          "them with one tokenizer (set data.tokenizer to check which)")
    names = [s.name for s in sources]
    if len(names) != len(set(names)):
        raise ConfigError(f"data.sources have duplicate names {names}: set data.sources[].name to tell them apart")
    return sources
