"""Shard sets as packed-row sources, laid out so that each rank reads a small, mostly private part of the data.

Windows. Epoch e of a source is its shards in a shuffled order (seeded by (seed, source, e)), documents back to
back; row window w is tokens [w*L, w*L + L + 1) of that stream (L = seq_len; consecutive windows overlap by one
token, so every token is a target exactly once per epoch), W = (tokens - 1) // L windows per epoch.

Lanes (locality by design). A source has N lanes (N = its share of the global batch, fixed by the config, never
by the world size). Lane l owns the l-th of N contiguous chunks of the epoch's windows and reads it front to
back, in blocks of `shuffle_block` windows whose order inside the block is shuffled (seeded by (seed, source,
e, l, block)). Row k of the source is epoch e = k // W, r = k % W, lane r % N, the (r // N)-th window of that
lane. A global batch takes ~N consecutive rows of the source, i.e. one row from every lane, so a lane advances
one window per optimizer step; the loader (titanloop.data.loader) gives each lane to one rank. A rank therefore
reads its lanes' chunks sequentially, one contiguous byte range per block, and no other rank reads those bytes.

Reads. Every shard has an index (titanloop.data.shard_format): a token range of a shard is one ranged read
(local pread, or an HTTP range GET on s3://). Sets written without an index are read whole, once per shard.
Fetched blocks, indexes and whole shards share an LRU cache of `cache_mb` per source.

Checks, all failing with one line naming the shard (ShardError) or the field (ConfigError): manifest format
vs data.kind, tokenizer fingerprint vs data.tokenizer (and across sources), vocabulary vs the model's vocab_size,
missing or wrong-size files at startup (local sets), index sha1 and counts when first read, and per document
fully inside a read: the record's stored size and (verify_checksums) the crc32 of its tokens; whole-shard
reads check the shard's sha1. With on_bad_shard="skip", rows touching a bad shard come out fully masked
(labels all -100), a warning names the shard once and `bad_rows` counts them.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import os
import random
import tempfile
import time
import zlib
from collections import OrderedDict

import numpy as np

from titanloop.config_errors import ConfigError, require
from titanloop.data.config import DataConfig, SourceConfig
from titanloop.data.errors import ShardError
from titanloop.data.packing import PackedRow, rows_to_batch
from titanloop.data.shard_format import MANIFEST, Manifest, ShardIndex, build_index, sha1_bytes
from titanloop.data.tokenizer import tokenizer_fingerprint

log = logging.getLogger(__name__)

S3_TRANSIENT_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestTimeout",
    "InternalError",
    "ServiceUnavailable",
    "503",
    "500",
    "502",
    "504",
}
S3_ACCESS_CODES = {
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "403",
    "InvalidToken",
    "AllAccessDisabled",
}


def is_remote(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


class ShardFetcher:
    """Reads files and byte ranges of a shard set, counting bytes and requests.

    Local paths: pread. s3://: boto3 ranged GETs (endpoint from S3_ENDPOINT_URL or AWS_ENDPOINT_URL), transient
    errors (5xx, throttling, connection) retried `retries` times with exponential backoff; a missing bucket or
    object, or refused credentials, is one ShardError line. Other URLs (gs://, ...): the whole file is downloaded
    once into cache_dir with mosaicml-streaming's downloaders, then read locally.
    """

    def __init__(self, root: str, cache_dir: str | None = None, retries: int = 5, backoff: float = 0.2):
        self.root = root.removeprefix("file://").rstrip("/")
        self.remote = is_remote(root)
        self.s3 = self.root.startswith("s3://")
        self.retries, self.backoff = retries, backoff
        self.bytes_fetched = self.requests = self.retried = 0
        self._client = None
        if self.remote and not self.s3:
            base = cache_dir or os.path.join(tempfile.gettempdir(), "titanloop-shard-cache")
            self.cache = os.path.join(base, hashlib.sha1(self.root.encode()).hexdigest()[:16])

    def location(self, rel: str) -> str:
        return f"{self.root}/{rel}"

    # ----- s3 -----------------------------------------------------------------------------------
    def client(self):
        if self._client is None:
            import boto3
            from botocore.config import Config

            endpoint = os.environ.get("S3_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL") or None
            retries = {"total_max_attempts": 1, "mode": "standard"}  # retried here, with our backoff and errors
            self._client = boto3.session.Session().client(  # own session: credentials read now, not cached
                "s3", endpoint_url=endpoint, config=Config(retries=retries, connect_timeout=10, read_timeout=60)
            )
        return self._client

    def _s3_get(self, rel: str, start: int | None, stop: int | None) -> bytes:
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

        bucket, _, prefix = self.root.removeprefix("s3://").partition("/")
        key = f"{prefix}/{rel}" if prefix else rel
        where = self.location(rel)
        kw = {} if start is None else {"Range": f"bytes={start}-{stop - 1}"}
        for attempt in range(self.retries + 1):
            try:
                self.requests += 1
                body = self.client().get_object(Bucket=bucket, Key=key, **kw)["Body"].read()
                self.bytes_fetched += len(body)
                return body
            except NoCredentialsError:
                raise ShardError(
                    where,
                    "no AWS credentials found",
                    "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)",
                ) from None
            except ClientError as e:
                code = str(e.response.get("Error", {}).get("Code", ""))
                status = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
                if code == "NoSuchBucket":
                    raise ShardError(
                        where, f"bucket {bucket!r} does not exist", "check data.sources[].path and the S3 endpoint"
                    ) from None
                if code in ("NoSuchKey", "404"):
                    raise ShardError(where, "missing", "restore it or re-create the shard set") from None
                if code in S3_ACCESS_CODES:
                    raise ShardError(
                        where,
                        f"access refused ({code})",
                        "check the AWS credentials (AWS_ACCESS_KEY_ID / AWS_PROFILE) and the bucket policy",
                    ) from None
                if not (code in S3_TRANSIENT_CODES or status >= 500):
                    raise ShardError(where, f"S3 error {code} (HTTP {status})", "check the URL") from None
                problem = f"{code} (HTTP {status})"
            except (BotoCoreError, OSError) as e:  # connection refused / reset / timeouts
                problem = f"{type(e).__name__}: {e}"
            if attempt < self.retries:
                self.retried += 1
                time.sleep(self.backoff * 2**attempt * (0.5 + random.random()))
        raise ShardError(
            where,
            f"still failing after {self.retries + 1} attempts ({problem})",
            "check the S3 endpoint and network, or raise data.io_retries",
        )

    # ----- generic ------------------------------------------------------------------------------
    def _local_path(self, rel: str) -> str:
        if not self.remote:
            return os.path.join(self.root, rel)
        from streaming.base.storage import CloudDownloader

        local = os.path.join(self.cache, rel)
        if not os.path.exists(local):
            try:
                CloudDownloader.direct_download(self.location(rel), local)
            except Exception as e:
                raise ShardError(
                    self.location(rel), f"download failed ({type(e).__name__}: {e})", "check the URL and credentials"
                ) from None
            self.requests += 1
            self.bytes_fetched += os.path.getsize(local)
        return local

    def read(self, rel: str) -> bytes:
        """The whole file."""
        if self.s3:
            return self._s3_get(rel, None, None)
        return self.read_range(rel, 0, None)

    def read_range(self, rel: str, start: int, stop: int | None) -> bytes:
        """Bytes [start, stop) of a file (stop None = to the end)."""
        if self.s3:
            return self._s3_get(rel, start, stop) if stop is not None else self._s3_get(rel, None, None)[start:]
        path = self._local_path(rel)
        try:
            with open(path, "rb") as f:
                f.seek(start)
                data = f.read() if stop is None else f.read(stop - start)
        except FileNotFoundError:
            raise ShardError(self.location(rel), "missing", "restore it or re-create the shard set") from None
        if not self.remote:  # remote files were counted when downloaded
            self.requests += 1
            self.bytes_fetched += len(data)
        return data


def read_manifest(root: str, cache_dir: str | None = None, retries: int = 5) -> Manifest:
    fetcher = ShardFetcher(root, cache_dir, retries)
    where = fetcher.location(MANIFEST)
    try:
        text = fetcher.read(MANIFEST).decode("utf-8")
    except ShardError as e:
        if "missing" not in str(e):
            raise
        raise ShardError(
            where,
            "missing",
            "point data.sources[].path at a directory written by data_pipelines (it holds manifest.json)",
        ) from None
    return Manifest.from_json(text, where)


class _Cache:
    """LRU of fetched blocks / indexes / shards with a byte budget."""

    def __init__(self, budget: int):
        self.budget, self.size, self.items = budget, 0, OrderedDict()
        self.evictions = self.peak = 0

    def get(self, key):
        if key in self.items:
            self.items.move_to_end(key)
            return self.items[key][0]
        return None

    def put(self, key, value, nbytes: int):
        self.items[key] = (value, nbytes)
        self.size += nbytes
        while self.size > self.budget and len(self.items) > 1:
            _, (_, n) = self.items.popitem(last=False)
            self.size -= n
            self.evictions += 1
        self.peak = max(self.peak, self.size)
        return value


class ShardSource:
    """Packed rows of one shard set (see the module docstring)."""

    def __init__(
        self, src: SourceConfig, cfg: DataConfig, seq_len: int, vocab_size: int, expected_fingerprint: str | None
    ):
        self.fetcher = ShardFetcher(src.path, cfg.cache_dir, cfg.io_retries)
        self.manifest = m = read_manifest(src.path, cfg.cache_dir, cfg.io_retries)
        self.name = src.name or m.source
        self.seq_len, self.seed = seq_len, cfg.seed
        self.block = int(cfg.shuffle_block)
        self.on_bad_shard, self.verify = cfg.on_bad_shard, cfg.verify_checksums
        if cfg.kind != "shards":
            require(
                m.format == cfg.kind,
                "data.kind",
                cfg.kind,
                f"{m.format!r} (or 'shards'): the shard set {src.path} is in {m.format} format",
            )
        fp = m.tokenizer.get("fingerprint")
        if expected_fingerprint is not None and fp != expected_fingerprint:
            raise ShardError(
                self.fetcher.location(MANIFEST),
                f"was written with tokenizer {fp}, data.tokenizer={cfg.tokenizer} is {expected_fingerprint}",
                "re-tokenize the source or configure the tokenizer it was written with",
            )
        require(
            int(m.tokenizer.get("vocab_size", 0)) <= vocab_size,
            "vocab_size",
            vocab_size,
            f">= {m.tokenizer.get('vocab_size')}, the vocabulary of shard set {src.path}",
        )
        self.bad_shards: set[int] = set()
        self.bad_rows = 0
        for i, shard in enumerate(m.shards):
            if shard.tokenizer != fp:
                self._bad(
                    i,
                    f"was written with tokenizer {shard.tokenizer}, its manifest says {fp}",
                    "remove it from the manifest or re-tokenize it",
                )
            elif not self.fetcher.remote:
                for rel, size in ((shard.path, shard.bytes), (shard.index, shard.index_bytes)):
                    path = os.path.join(self.fetcher.root, rel) if rel else None
                    if path and not os.path.isfile(path):
                        self._bad(
                            i,
                            f"{'index ' if rel == shard.index else ''}missing",
                            "restore it or re-create the shard set",
                        )
                    elif path and os.path.getsize(path) != size:
                        self._bad(
                            i,
                            f"{rel} has {os.path.getsize(path)} bytes, the manifest says {size}: truncated or corrupt",
                        )
        self.shard_tokens = np.array([s.tokens for s in m.shards], dtype=np.int64)
        self.token_offsets = np.concatenate([[0], np.cumsum(self.shard_tokens)]).astype(np.int64)  # corpus order
        self.windows = (int(self.token_offsets[-1]) - 1) // seq_len
        require(
            self.windows >= 1,
            "seq_len",
            seq_len,
            f"< {int(self.token_offsets[-1])} tokens, the size of shard set {src.path}",
        )
        self.vocab_size = vocab_size
        self.itemsize = np.dtype(m.dtype).itemsize
        # shard bytes per token (records, metadata and headers included): what reading the set once costs per token
        self.bytes_per_token = sum(s.bytes for s in m.shards) / max(int(self.token_offsets[-1]), 1)
        self.eos_id = int(m.tokenizer.get("eos_id", 0))
        self._key = int(hashlib.sha1(self.name.encode()).hexdigest()[:8], 16)
        self._cache = _Cache(int(cfg.cache_mb) << 20)
        self._layout: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._perms: dict[int, tuple[tuple[int, int], np.ndarray]] = {}
        self.lanes = 1
        self.used_bytes = 0
        self.trace: list | None = None  # set to a list to record (row, corpus token offset) of every row read

    def set_lanes(self, n: int) -> None:
        self.lanes = max(1, int(n))

    def clone(self) -> "ShardSource":
        """An independent reader of the same set (fresh cache and counters): one simulated rank."""
        c = copy.copy(self)
        c.fetcher = copy.copy(self.fetcher)
        c.fetcher.bytes_fetched = c.fetcher.requests = c.fetcher.retried = 0
        c.fetcher._client = None
        c._cache = _Cache(self._cache.budget)
        c._perms, c.used_bytes, c.bad_rows, c.bad_shards = {}, 0, 0, set(self.bad_shards)
        return c

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

    # ----- layout -------------------------------------------------------------------------------
    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(shard order, stream token offsets) of an epoch."""
        if epoch not in self._layout:
            if len(self._layout) > 2:
                self._layout.clear()
            order = np.random.default_rng([self.seed, self._key, epoch]).permutation(len(self.shard_tokens))
            self._layout[epoch] = order, np.concatenate([[0], np.cumsum(self.shard_tokens[order])])
        return self._layout[epoch]

    def _lane_span(self, lane: int) -> tuple[int, int]:
        q, rem = divmod(self.windows, self.lanes)
        return lane * q + min(lane, rem), q + (lane < rem)

    def _locate(self, k: int) -> tuple[int, int, int, int, int]:
        """Row k -> (epoch, lane, block, first window of the block, window)."""
        epoch, r = divmod(k, self.windows)
        lane, t = r % self.lanes, r // self.lanes
        start, length = self._lane_span(lane)
        block, pos = divmod(t, self.block)
        first = start + block * self.block
        key = (epoch, block)
        if lane not in self._perms or self._perms[lane][0] != key:
            size = min(self.block, length - block * self.block)
            self._perms[lane] = key, np.random.default_rng([self.seed, self._key, epoch, lane, block]).permutation(size)
        return epoch, lane, block, first, first + int(self._perms[lane][1][pos])

    # ----- rows ---------------------------------------------------------------------------------
    def row(self, k: int, local: bool = True) -> PackedRow:
        """Row k. local=True: this rank owns the row's lane, so its whole block is read (once) and cached;
        local=False (a row handed over to balance a step): only the row's own window is read."""
        epoch, lane, block, first, w = self._locate(k)
        L = self.seq_len
        if local:
            key = ("block", epoch, lane, block)
            size = min(self.block, self._lane_span(lane)[1] - block * self.block)
            lo, hi = first * L, (first + size) * L + 1
        else:
            key, lo, hi = ("window", epoch, w), w * L, w * L + L + 1
        part = self._cache.get(key)
        if part is None:
            part = self._read_stream(epoch, lo, hi)
            self._cache.put(key, part, 0 if part is None else sum(a.nbytes for a in part))
        self.used_bytes += (L + 1) * self.bytes_per_token
        if self.trace is not None:
            order, offs = self._epoch(epoch)
            i = int(np.searchsorted(offs, w * L, side="right")) - 1
            self.trace.append((k, int(self.token_offsets[order[i]] + w * L - offs[i])))
        return self._masked_row() if part is None else self._window(part, w * L - lo)

    def _window(self, part, a: int) -> PackedRow:
        """The row of L + 1 tokens at offset `a` of a stream piece (tokens, doc ids, targets) from _read_stream."""
        tokens, doc_ids, targets = (x[a : a + self.seq_len + 1] for x in part)
        return PackedRow(tokens.astype(np.int64), doc_ids.astype(np.int64), targets)

    def _masked_row(self) -> PackedRow:
        """A row of a bad shard (on_bad_shard='skip'): EOS tokens, no target; counted in bad_rows."""
        self.bad_rows += 1
        n = self.seq_len + 1
        return PackedRow(np.full(n, self.eos_id, np.int64), np.zeros(n, np.int64), np.zeros(n, bool))

    def every_window(self, chunk: int = 256):
        """Every window of the set once, in order (the stream of epoch 0, unshuffled within it): how a held-out
        set is scored whole (validation.steps = 0, `titanloop.eval --data <shard set>`). Rows of a bad shard come
        out fully masked, as from `row`."""
        L = self.seq_len
        for first in range(0, self.windows, chunk):
            last = min(first + chunk, self.windows)
            part = self._read_stream(0, first * L, last * L + 1)
            for w in range(first, last):
                yield self._masked_row() if part is None else self._window(part, (w - first) * L)

    def _read_stream(self, epoch: int, lo: int, hi: int):
        """Tokens [lo, hi) of the epoch's stream as (tokens, doc ids, targets), or None if a shard is bad."""
        order, offs = self._epoch(epoch)
        pieces = []
        i = int(np.searchsorted(offs, lo, side="right")) - 1
        while i < len(order) and offs[i] < hi:
            s = int(order[i])
            a, z = max(lo, int(offs[i])) - int(offs[i]), min(hi, int(offs[i + 1])) - int(offs[i])
            if z > a:
                piece = self._read_piece(s, a, z)
                if piece is None:
                    return None
                pieces.append(piece)
            i += 1
        tokens = np.concatenate([p[0] for p in pieces])
        doc_ids = np.cumsum(np.concatenate([p[1] for p in pieces]), dtype=np.int32)
        return tokens, doc_ids, np.concatenate([p[2] for p in pieces])

    def _index(self, s: int) -> ShardIndex | None:
        """The head (token table) of shard s's index, fetched once and cached; None if it has no index."""
        info = self.manifest.shards[s]
        if not info.index:
            return None
        key = ("index", s)
        idx = self._cache.get(key)
        if idx is None:
            where = self.fetcher.location(info.index)
            idx = ShardIndex.parse_head(self.fetcher.read_range(info.index, 0, 12 + 4 * (info.documents + 1)), where)
            if len(idx.token_start) - 1 != info.documents or int(idx.token_start[-1]) != info.tokens:
                raise ShardError(
                    where,
                    f"describes {len(idx.token_start) - 1} documents / {int(idx.token_start[-1])} "
                    f"tokens, the manifest says {info.documents} / {info.tokens}",
                )
            self._cache.put(key, idx, idx.token_start.nbytes)
        return idx

    def _whole(self, s: int) -> tuple[ShardIndex, np.ndarray, bytes]:
        """Index head, all records and bytes of a shard written without an index (read once, cached)."""
        key = ("whole", s)
        got = self._cache.get(key)
        if got is None:
            info = self.manifest.shards[s]
            where = self.fetcher.location(info.path)
            data = self.fetcher.read(info.path)
            if len(data) != info.bytes:
                raise ShardError(where, f"has {len(data)} bytes, the manifest says {info.bytes}: truncated or corrupt")
            if self.verify and sha1_bytes(data) != info.sha1:
                raise ShardError(where, "sha1 differs from the manifest: corrupt or replaced")
            raw = build_index(self.manifest.format, data, self.manifest.dtype, where)
            idx = ShardIndex.parse_head(raw, where)
            got = self._cache.put(key, (idx, ShardIndex.parse_records(raw[idx.head_bytes :]), data), len(data))
        return got

    def _read_piece(self, s: int, a: int, z: int):
        """Tokens [a, z) of shard s: (tokens, document-start flags, targets), or None if the shard is bad."""
        if s in self.bad_shards:
            return None
        info = self.manifest.shards[s]
        where = self.fetcher.location(info.path)
        try:
            idx, data, base = self._index(s), None, 0
            if idx is None:
                idx, records, data = self._whole(s)
            ts, w = idx.token_start, self.itemsize
            if len(ts) - 1 != info.documents or int(ts[-1]) != info.tokens:
                raise ShardError(
                    where,
                    f"holds {len(ts) - 1} documents / {int(ts[-1])} tokens, the manifest says "
                    f"{info.documents} / {info.tokens}",
                )
            i0 = int(np.searchsorted(ts, a, side="right")) - 1
            i1 = int(np.searchsorted(ts, z - 1, side="right")) - 1
            if data is None:
                r_lo, r_hi = idx.records_range(i0, i1)
                rec = ShardIndex.parse_records(self.fetcher.read_range(info.index, r_lo, r_hi))
                if len(rec) != i1 - i0 + 1:
                    raise ShardError(self.fetcher.location(info.index), "is truncated (records missing)")
            else:
                rec = records[i0 : i1 + 1]
            record_start, payload_off, prompt_len, crc = (rec[:, c] for c in range(4))
            lo = int(record_start[0]) if ts[i0] == a else int(payload_off[0]) + w * (a - int(ts[i0]))
            hi = int(payload_off[-1]) + w * (z - int(ts[i1]))
            if not 0 <= lo <= hi <= info.bytes:
                raise ShardError(
                    self.fetcher.location(info.index),
                    f"points at bytes [{lo}, {hi}) outside the {info.bytes}-byte shard: corrupt",
                )
            if data is None:
                data, base = self.fetcher.read_range(info.path, lo, hi), lo
                if len(data) != hi - lo:
                    raise ShardError(where, f"ends before byte {hi}, the index says it holds more: truncated")
            chunks = []
            for n, d in enumerate(range(i0, i1 + 1)):
                d_lo, d_hi = max(a, int(ts[d])), min(z, int(ts[d + 1]))
                p = int(payload_off[n]) + w * (d_lo - int(ts[d])) - base
                chunks.append(data[p : p + w * (d_hi - d_lo)])
                if ts[d] >= a and ts[d + 1] <= z and record_start[n] >= lo:  # whole record in this read
                    self._check_record(
                        int(record_start[n]),
                        int(payload_off[n]),
                        int(crc[n]),
                        idx.size_field_rel,
                        data,
                        base,
                        w * int(ts[d + 1] - ts[d]),
                        chunks[-1],
                        where,
                        d,
                    )
            tokens = np.frombuffer(b"".join(chunks), dtype=self.manifest.dtype)
            if len(tokens) and int(tokens.max()) >= self.vocab_size:
                raise ShardError(where, f"has token id {int(tokens.max())} >= vocab_size={self.vocab_size}")
        except ShardError as e:
            if self.on_bad_shard == "error":
                raise
            log.warning("skipping bad shard (data.on_bad_shard='skip'): %s", e)
            self.bad_shards.add(s)
            return None
        pos = np.arange(a, z)
        doc = np.searchsorted(ts, pos, side="right") - 1
        return tokens, pos == ts[doc], pos - ts[doc] >= prompt_len[doc - i0]

    def _check_record(self, record_start, payload_off, crc, size_field_rel, data, base, nbytes, payload, where, d):
        if self.manifest.format == "mds":
            f = record_start + size_field_rel - base
            stored = int.from_bytes(data[f : f + 4], "little")
        else:
            f = payload_off - 512 + size_field_rel - base
            try:
                stored = int(data[f : f + 12].rstrip(b"\0 ").decode() or "-1", 8)
            except ValueError:
                stored = -1
        if stored != nbytes:
            raise ShardError(
                where, f"document {d}'s record says {stored} token bytes, the index says {nbytes}: corrupt or truncated"
            )
        if self.verify and zlib.crc32(payload) != crc:
            raise ShardError(where, f"document {d}'s tokens fail their crc32: corrupt or replaced")


def whole_set_batches(cfg: DataConfig, *, seq_len: int, vocab_size: int, batch_size: int) -> list[dict]:
    """Every window of every source of `cfg` once (ShardSource.every_window), as micro-batches of `batch_size`
    rows (the last one may be smaller): a held-out set scored whole."""
    rows = [r for src in open_shard_sources(cfg, seq_len=seq_len, vocab_size=vocab_size) for r in src.every_window()]
    return [
        rows_to_batch(rows[i : i + batch_size], list(range(i, min(i + batch_size, len(rows)))))
        for i in range(0, len(rows), batch_size)
    ]


def open_shard_sources(cfg: DataConfig, *, seq_len: int, vocab_size: int) -> list[ShardSource]:
    expected = tokenizer_fingerprint(cfg.tokenizer) if cfg.tokenizer else None
    sources = [ShardSource(s, cfg, seq_len, vocab_size, expected) for s in cfg.sources]
    fps = {s.manifest.tokenizer.get("fingerprint") for s in sources}
    if len(fps) > 1:
        raise ConfigError(
            f"data.sources were written with different tokenizers {sorted(fps)}: re-tokenize "
            "them with one tokenizer (set data.tokenizer to check which)"
        )
    names = [s.name for s in sources]
    if len(names) != len(set(names)):
        raise ConfigError(f"data.sources have duplicate names {names}: set data.sources[].name to tell them apart")
    return sources
