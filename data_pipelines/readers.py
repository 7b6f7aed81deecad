"""Streaming document readers: FineWeb-style parquet and Nemotron-CC-style (zstd) JSON lines.

Files are opened through pyarrow's filesystems, so local paths and s3:// / gs:// URLs work alike, and are
read in record batches / line by line: memory stays bounded by one batch, never a whole file or file set.
A document is (text, id, meta): `id` is the source's document id column when present, `meta` the other
scalar columns (url, dump, language_score, quality, ...).
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterator

import pyarrow.fs as pafs

PARQUET_SUFFIXES = (".parquet",)
JSONL_SUFFIXES = (".jsonl", ".jsonl.zst", ".jsonl.zstd", ".json.zst", ".json.zstd")
ID_COLUMNS = ("id", "warc_record_id", "doc_id")


def is_supported(path: str) -> bool:
    return path.endswith(PARQUET_SUFFIXES + JSONL_SUFFIXES)


def list_inputs(paths: list[str]) -> list[str]:
    """Expand directories (recursively) into supported files; keep files and URLs as given. Sorted, unique."""
    out = []
    for p in paths:
        fs, inner = pafs.FileSystem.from_uri(p) if "://" in p else (pafs.LocalFileSystem(), os.path.abspath(p))
        info = fs.get_file_info(inner)
        if info.type == pafs.FileType.Directory:
            infos = fs.get_file_info(pafs.FileSelector(inner, recursive=True))
            found = sorted(i.path for i in infos if i.type == pafs.FileType.File and is_supported(i.path))
            prefix = p[: p.index("://") + 3] if "://" in p else ""
            out += [prefix + f if prefix and not f.startswith(prefix) else f for f in found]
        elif info.type == pafs.FileType.File:
            if not is_supported(p):
                raise SystemExit(
                    f"error: input {p} is not a supported file: expected one of {PARQUET_SUFFIXES + JSONL_SUFFIXES}"
                )
            out.append(p)
        else:
            raise SystemExit(f"error: input {p} does not exist: pass parquet / jsonl(.zst) files or directories")
    return sorted(dict.fromkeys(out))


def _open(path: str):
    if "://" in path:
        fs, inner = pafs.FileSystem.from_uri(path)
        return fs.open_input_file(inner)
    return open(path, "rb")


def _meta(record: dict, text_column: str, id_column: str | None) -> dict:
    return {
        k: v if isinstance(v, (str, int, float, bool)) or v is None else str(v)
        for k, v in record.items()
        if k not in (text_column, id_column)
    }


def read_parquet(path: str, text_column: str = "text", batch_rows: int = 1024) -> Iterator[tuple[str, str, dict]]:
    import pyarrow.parquet as pq

    with _open(path) as f:
        pf = pq.ParquetFile(f)
        names = pf.schema_arrow.names
        if text_column not in names:
            raise SystemExit(f"error: {path} has no column {text_column!r} (columns: {names}); pass --text-column")
        id_column = next((c for c in ID_COLUMNS if c in names), None)
        row = 0
        for batch in pf.iter_batches(batch_size=batch_rows):
            for record in batch.to_pylist():
                doc_id = str(record[id_column]) if id_column else f"{os.path.basename(path)}:{row}"
                yield record[text_column] or "", doc_id, _meta(record, text_column, id_column)
                row += 1


def read_jsonl(path: str, text_column: str = "text") -> Iterator[tuple[str, str, dict]]:
    import zstandard

    with _open(path) as raw:
        stream = zstandard.ZstdDecompressor().stream_reader(raw) if path.endswith(("zst", "zstd")) else raw
        lines = io.TextIOWrapper(stream, encoding="utf-8")
        for row, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise SystemExit(f"error: {path} line {row + 1} is not JSON ({e.msg}); the file is corrupt") from None
            if text_column not in record:
                raise SystemExit(f"error: {path} line {row + 1} has no key {text_column!r}; pass --text-column")
            id_column = next((c for c in ID_COLUMNS if c in record), None)
            doc_id = str(record[id_column]) if id_column else f"{os.path.basename(path)}:{row}"
            yield record[text_column] or "", doc_id, _meta(record, text_column, id_column)


def read_documents(path: str, text_column: str = "text") -> Iterator[tuple[str, str, dict]]:
    """(text, id, meta) for every document of one input file, in file order."""
    if path.endswith(PARQUET_SUFFIXES):
        return read_parquet(path, text_column)
    return read_jsonl(path, text_column)
