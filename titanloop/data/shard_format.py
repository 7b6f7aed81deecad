"""On-disk shard formats (MDS and webdataset) and the manifest that describes a shard set.

A shard set is a directory (local or s3://, gs://, ...) with `manifest.json` and shard files. Each
*document* is stored whole, already tokenized, in the order the pipeline read it:
  tokens      raw little-endian token ids (dtype `uint16` when the vocabulary fits, else `uint32`),
              ending with the EOS id (the separator between documents)
  id          the source's document id (FineWeb `id`, Nemotron-CC `warc_record_id`, ...) or a generated one
  prompt_len  leading tokens that are not training targets (synthetic-task prompts; 0 for text)
  meta        JSON object with the remaining metadata columns (url, dump, language_score, ...)

MDS (mosaicml-streaming): `part-NNNNN/shard.SSSSS.mds` + `part-NNNNN/index.json` per input part, and a merged
top-level `index.json`, so `streaming.StreamingDataset` can read the set too. Columns: tokens=bytes, id=str,
prompt_len=int, meta=json.
webdataset: `part-NNNNN-SSSSSS.tar`, one sample per document: `<key>.tokens` (raw bytes) and `<key>.json`
({"id", "prompt_len", "meta"}).

manifest.json (version 1):
  {"version": 1, "format": "mds" | "webdataset", "source": "fineweb-edu",
   "tokenizer": {"fingerprint": "sha1:...", "vocab_size": 49152, "eos_id": 0, "path": "..."},
   "dtype": "uint16", "documents": D, "tokens": T, "inputs": [...],
   "shards": [{"path": "part-00000/shard.00000.mds", "documents": d, "tokens": t, "bytes": b, "sha1": "...",
               "tokenizer": "sha1:...", "index": "part-00000/shard.00000.mds.idx", "index_bytes": i,
               "index_sha1": "..."}, ...]}

Shard index (`<shard>.idx`, written beside every shard; optional: sets without it are read whole), little-endian
uint32: magic "TLIX", documents D, size_field_rel; token_start [D+1] (first token of each document in the
shard); then one 16-byte record per document: record_start (byte offset of its record: MDS sample / first tar
member header), payload_off (byte offset of its token bytes), prompt_len, crc32 (of its token bytes).
size_field_rel says where a record stores its token-byte count (MDS: u32 at record_start + size_field_rel;
tar: octal size at payload_off - 512 + 124). A reader fetches the token table once (4 bytes per document) and
then only the records of the documents it reads, so a token range of a shard costs one byte range of the
shard plus one small range of the index (titanloop.data.shards).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
import zlib
from dataclasses import asdict, dataclass, field

import numpy as np

from titanloop.config_errors import ConfigError
from titanloop.data.errors import ShardError

MANIFEST = "manifest.json"
INDEX_SUFFIX = ".idx"
MANIFEST_VERSION = 1
FORMATS = ("mds", "webdataset")
MDS_COLUMNS = {"tokens": "bytes", "id": "str", "prompt_len": "int", "meta": "json"}
DEFAULT_SHARD_BYTES = 64 << 20


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


@dataclass
class ShardInfo:
    path: str  # relative to the shard-set directory
    documents: int
    tokens: int
    bytes: int
    sha1: str
    tokenizer: str  # fingerprint of the tokenizer that wrote it
    index: str | None = None  # relative path of the shard index (None: the shard is read whole)
    index_bytes: int = 0
    index_sha1: str | None = None


@dataclass
class Manifest:
    format: str
    source: str
    tokenizer: dict  # fingerprint, vocab_size, eos_id, path
    dtype: str
    shards: list[ShardInfo] = field(default_factory=list)
    inputs: list[str] = field(default_factory=list)
    version: int = MANIFEST_VERSION

    @property
    def documents(self) -> int:
        return sum(s.documents for s in self.shards)

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.shards)

    def to_json(self) -> str:
        d = asdict(self)
        d["documents"], d["tokens"] = self.documents, self.tokens
        return json.dumps(d, indent=1)

    @classmethod
    def from_json(cls, text: str, where: str) -> "Manifest":
        try:
            d = json.loads(text)
            if d.get("version") != MANIFEST_VERSION:
                raise ShardError(
                    where,
                    f"manifest version {d.get('version')!r} is not {MANIFEST_VERSION}",
                    "re-create the shard set with this titanloop's data_pipelines",
                )
            if d.get("format") not in FORMATS:
                raise ShardError(where, f"manifest format {d.get('format')!r} is not one of {FORMATS}")
            shards = [ShardInfo(**s) for s in d["shards"]]
            return cls(
                format=d["format"],
                source=d["source"],
                tokenizer=d["tokenizer"],
                dtype=d["dtype"],
                shards=shards,
                inputs=d.get("inputs", []),
            )
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ShardError(where, f"manifest is unreadable ({type(e).__name__}: {e})") from None


def sha1_bytes(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()


# ----- writing ---------------------------------------------------------------------------------------
class ShardWriter:
    """Writes documents of one input part into size-limited shards of one format; `finish()` -> ShardInfos.

    out_dir is local (the pipeline stages remote outputs locally and uploads them afterwards).
    """

    def __init__(
        self, fmt: str, out_dir: str, part: int, dtype: str, fingerprint: str, shard_bytes: int = DEFAULT_SHARD_BYTES
    ):
        if fmt not in FORMATS:
            raise ConfigError(f"format={fmt!r} is invalid: expected one of {FORMATS}")
        self.fmt, self.out_dir, self.part = fmt, out_dir, part
        self.dtype, self.fingerprint, self.shard_bytes = np.dtype(dtype), fingerprint, shard_bytes
        self.doc_tokens: list[int] = []  # tokens of every document, in order (MDS shard accounting)
        self.shards: list[ShardInfo] = []
        if fmt == "mds":
            from streaming import MDSWriter

            self.part_dir = f"part-{part:05d}"
            self._mds = MDSWriter(out=os.path.join(out_dir, self.part_dir), columns=MDS_COLUMNS, size_limit=shard_bytes)
        else:
            self._tar, self._tar_bytes, self._tar_docs, self._tar_tokens = None, 0, 0, 0

    def write(self, tokens, doc_id: str, prompt_len: int = 0, meta: dict | None = None) -> None:
        arr = np.asarray(tokens).astype(self.dtype, copy=False)
        data = arr.tobytes()
        self.doc_tokens.append(len(arr))
        if self.fmt == "mds":
            self._mds.write({"tokens": data, "id": doc_id, "prompt_len": int(prompt_len), "meta": meta or {}})
            return
        if self._tar is None or self._tar_bytes >= self.shard_bytes:
            self._close_tar()
            self._open_tar()
        key = f"{self.part:05d}{len(self.doc_tokens) - 1:010d}"
        info = json.dumps({"id": doc_id, "prompt_len": int(prompt_len), "meta": meta or {}}).encode()
        self._tar.write({"__key__": key, "tokens": data, "json": info})
        self._tar_bytes += len(data) + len(info) + 1536  # two headers + padding, roughly
        self._tar_docs += 1
        self._tar_tokens += len(arr)

    def _open_tar(self) -> None:
        import webdataset as wds

        name = f"part-{self.part:05d}-{len(self.shards):06d}.tar"
        self._tar_path = name
        self._tar = wds.TarWriter(os.path.join(self.out_dir, name), mtime=0)  # reproducible bytes
        self._tar_bytes = self._tar_docs = self._tar_tokens = 0

    def _close_tar(self) -> None:
        if self._tar is None:
            return
        self._tar.close()
        self.shards.append(self._describe(self._tar_path, self._tar_docs, self._tar_tokens))
        self._tar = None

    def _describe(self, rel: str, documents: int, tokens: int) -> ShardInfo:
        with open(os.path.join(self.out_dir, rel), "rb") as f:
            data = f.read()
        index = build_index(self.fmt, data, self.dtype.name, rel)
        with open(os.path.join(self.out_dir, rel + INDEX_SUFFIX), "wb") as f:
            f.write(index)
        return ShardInfo(
            rel,
            documents,
            tokens,
            len(data),
            sha1_bytes(data),
            self.fingerprint,
            rel + INDEX_SUFFIX,
            len(index),
            sha1_bytes(index),
        )

    def finish(self) -> list[ShardInfo]:
        if self.fmt == "webdataset":
            self._close_tar()
            return self.shards
        self._mds.finish()
        with open(os.path.join(self.out_dir, self.part_dir, "index.json")) as f:
            index = json.load(f)
        start = 0
        for shard in index["shards"]:
            n = shard["samples"]
            rel = f"{self.part_dir}/{shard['raw_data']['basename']}"
            self.shards.append(self._describe(rel, n, sum(self.doc_tokens[start : start + n])))
            start += n
        return self.shards


# ----- reading ---------------------------------------------------------------------------------------
@dataclass
class ShardData:
    """One decoded shard: all its tokens back to back, document offsets, per-document prompt lengths."""

    tokens: np.ndarray  # [n_tokens] in the manifest dtype
    doc_starts: np.ndarray  # int64 [documents + 1]
    prompt_lens: np.ndarray  # int64 [documents]
    ids: list[str]


@dataclass
class _Scan:
    """Where every document of a shard file lies: record start, token-payload offset and length (bytes)."""

    record_start: list[int] = field(default_factory=list)
    payload_off: list[int] = field(default_factory=list)
    payload_len: list[int] = field(default_factory=list)
    prompt_lens: list[int] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)
    size_field_rel: int = 0


def _scan(fmt: str, data: bytes, where: str) -> _Scan:
    try:
        return (_scan_mds if fmt == "mds" else _scan_tar)(data)
    except ShardError:
        raise
    except Exception as e:  # malformed bytes surface as many exception types
        raise ShardError(
            where, f"cannot be decoded as {fmt} ({type(e).__name__}: {e}); it is corrupt or truncated"
        ) from None


def decode_shard(fmt: str, data: bytes, dtype: str, where: str) -> ShardData:
    """Parse a whole shard file; any structural problem is a ShardError naming `where`."""
    sc = _scan(fmt, data, where)
    width = np.dtype(dtype).itemsize
    if any(n % width for n in sc.payload_len):
        raise ShardError(where, f"a document's token bytes are not a multiple of {dtype}; corrupt shard")
    tokens = np.frombuffer(b"".join(data[o : o + n] for o, n in zip(sc.payload_off, sc.payload_len)), dtype=dtype)
    lengths = np.asarray(sc.payload_len, dtype=np.int64) // width
    doc_starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return ShardData(tokens, doc_starts, np.asarray(sc.prompt_lens, dtype=np.int64), sc.ids)


INDEX_MAGIC = b"TLIX"
INDEX_HEADER = 12  # magic, documents D (u32), size_field_rel (u32)
INDEX_RECORD = 16  # per document: record_start, payload_off, prompt_len, crc32 (u32 each)


def build_index(fmt: str, data: bytes, dtype: str, where: str) -> bytes:
    """The shard index (module docstring) of a whole shard file."""
    sc = _scan(fmt, data, where)
    width = np.dtype(dtype).itemsize
    if any(n % width for n in sc.payload_len):
        raise ShardError(where, f"a document's token bytes are not a multiple of {dtype}; corrupt shard")
    if len(data) >= 1 << 32:
        raise ShardError(where, "is 4 GiB or larger", "write smaller shards (--shard-bytes)")
    lengths = np.asarray(sc.payload_len, dtype=np.int64) // width
    crc = [zlib.crc32(data[o : o + n]) for o, n in zip(sc.payload_off, sc.payload_len)]
    records = np.stack([sc.record_start, sc.payload_off, sc.prompt_lens, crc], axis=1) if crc else np.zeros((0, 4))
    return (
        INDEX_MAGIC
        + np.asarray([len(crc), sc.size_field_rel], "<u4").tobytes()
        + np.concatenate([[0], np.cumsum(lengths)]).astype("<u4").tobytes()
        + records.astype("<u4").tobytes()
    )


@dataclass
class ShardIndex:
    """The head of a shard index (token_start) and, for a range of documents, their records."""

    token_start: np.ndarray  # int64 [D+1]
    size_field_rel: int

    @property
    def head_bytes(self) -> int:
        return INDEX_HEADER + 4 * len(self.token_start)

    @classmethod
    def parse_head(cls, data: bytes, where: str) -> "ShardIndex":
        """From the first bytes of an index (at least INDEX_HEADER; token_start if present)."""
        if data[:4] != INDEX_MAGIC or len(data) < INDEX_HEADER:
            raise ShardError(where, "is not a titanloop shard index", "re-create the shard set")
        n, rel = np.frombuffer(data[4:INDEX_HEADER], "<u4").tolist()
        head = data[INDEX_HEADER : INDEX_HEADER + 4 * (n + 1)]
        if len(head) != 4 * (n + 1):
            raise ShardError(where, f"ends inside its token table ({len(data)} bytes for {n} documents)")
        starts = np.frombuffer(head, "<u4").astype(np.int64)
        if np.any(np.diff(starts) < 0):
            raise ShardError(where, "token table is not increasing: corrupt")
        return cls(starts, rel)

    def records_range(self, i0: int, i1: int) -> tuple[int, int]:
        """Byte range of the records of documents [i0, i1] in the index file."""
        base = self.head_bytes
        return base + INDEX_RECORD * i0, base + INDEX_RECORD * (i1 + 1)

    @staticmethod
    def parse_records(data: bytes) -> np.ndarray:
        """int64 [n, 4]: record_start, payload_off, prompt_len, crc32."""
        return np.frombuffer(data, "<u4").astype(np.int64).reshape(-1, 4)


def _mds_decode(encoding: str, raw: bytes):
    """The MDS encodings titanloop writes (streaming.base.format.mds.encodings), without importing
    mosaicml-streaming (its import pulls in much of torch and takes seconds on every rank)."""
    if encoding == "str":
        return raw.decode("utf-8")
    if encoding == "int":
        return int(np.frombuffer(raw, np.int64)[0])
    if encoding == "json":
        return json.loads(raw.decode("utf-8"))
    raise ValueError(f"unexpected MDS column encoding {encoding!r}")


def _scan_mds(data: bytes) -> _Scan:
    n = int(np.frombuffer(data[:4], np.uint32)[0])
    offsets = np.frombuffer(data[4 : 8 + 4 * n], np.uint32).astype(np.int64)
    if len(offsets) != n + 1 or offsets[-1] != len(data):
        raise ValueError(f"offset table says {offsets[-1] if len(offsets) else '?'} bytes, file has {len(data)}")
    config_end = int(offsets[0])
    config = json.loads(data[8 + 4 * n : config_end])
    names, encodings, sizes = config["column_names"], config["column_encodings"], config["column_sizes"]
    if dict(zip(names, encodings)).get("tokens") != "bytes":
        raise ValueError(f"columns {dict(zip(names, encodings))} have no `tokens: bytes` column")
    var_names = [name for name, size in zip(names, sizes) if not size]
    sc = _Scan(size_field_rel=4 * var_names.index("tokens"))
    for i in range(n):
        lo, hi = int(offsets[i]), int(offsets[i + 1])
        var_sizes = iter(np.frombuffer(data[lo : lo + 4 * len(var_names)], np.uint32).tolist())
        pos = lo + 4 * len(var_names)
        sample = {}
        for name, enc, size in zip(names, encodings, sizes):
            size = size or next(var_sizes)
            if name == "tokens":
                sc.payload_off.append(pos)
                sc.payload_len.append(size)
            elif name in ("id", "prompt_len"):
                sample[name] = _mds_decode(enc, data[pos : pos + size])
            pos += size
        if pos != hi:
            raise ValueError(f"sample {i} spans {pos - lo} bytes, its offsets say {hi - lo}")
        sc.record_start.append(lo)
        sc.ids.append(str(sample.get("id", i)))
        sc.prompt_lens.append(int(sample.get("prompt_len", 0)))
    return sc


def _scan_tar(data: bytes) -> _Scan:
    """Samples are consecutive members sharing a key: `<key>.tokens` (required), `<key>.json` (optional)."""
    sc = _Scan(size_field_rel=124)  # ustar header: 12-byte octal size at offset 124
    sample: dict = {}

    def finish():
        if not sample:
            return
        if "tokens" not in sample:
            raise ValueError(f"sample {sample['key']!r} has no .tokens member")
        info = json.loads(sample["json"]) if "json" in sample else {}
        sc.record_start.append(sample["start"])
        sc.payload_off.append(sample["tokens"][0])
        sc.payload_len.append(sample["tokens"][1])
        sc.prompt_lens.append(int(info.get("prompt_len", 0)))
        sc.ids.append(str(info.get("id", sample["key"])))

    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        for member in tar:
            if not member.isfile():
                continue
            key, _, ext = member.name.partition(".")
            if member.offset_data + member.size > len(data):
                raise ValueError(f"member {member.name} is truncated")
            if sample.get("key") != key:
                finish()
                sample = {"key": key, "start": member.offset}
            if ext == "tokens":  # its ustar header (with the size field) is the 512 bytes before the data
                sample["tokens"] = (member.offset_data, member.size)
            elif ext == "json":
                sample["json"] = data[member.offset_data : member.offset_data + member.size]
    finish()
    return sc
