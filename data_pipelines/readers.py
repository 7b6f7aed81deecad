"""Streaming document readers: FineWeb-style parquet, Nemotron-CC-style (zstd) JSON lines and plain text.

Files are opened through pyarrow's filesystems, so local paths and s3:// / gs:// URLs work alike, and are
read in record batches / line by line: memory stays bounded by one batch (or one document), never a whole file
set. A document is (text, id, meta): `id` is the source's document id column when present, `meta` the other
scalar columns (url, dump, language_score, quality, ...). A document whose text is null (`"text": null`) is
yielded with text None, for the caller to count as dropped; any other non-string text is an error.
Errors are `InputError`s naming the file and, for JSON lines and text, the line.

Plain text (`.txt`, UTF-8) has no document boundaries of its own; `TextSplit` names the rule:
    file        the whole file is one document (default; e.g. tinyshakespeare)
    paragraph   documents are separated by one or more blank lines
    line        every non-blank line is a document
    start=REGEX a document starts at every line matching REGEX (re.match), e.g. WikiText's article titles
                `start=^ = [^=].* = $`; lines before the first match form a document of their own
Text inside a document is kept byte for byte (line ends included); the separators (blank lines) are dropped,
and so is each document's last line end (file: kept, the file is the document).
"""

from __future__ import annotations

import io
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow.fs as pafs

from data_pipelines.cli import InputError

PARQUET_SUFFIXES = (".parquet",)
JSONL_SUFFIXES = (".jsonl", ".jsonl.zst", ".jsonl.zstd", ".json.zst", ".json.zstd")
TEXT_SUFFIXES = (".txt",)
SUFFIXES = PARQUET_SUFFIXES + JSONL_SUFFIXES + TEXT_SUFFIXES
ID_COLUMNS = ("id", "warc_record_id", "doc_id")
TEXT_SPLITS = ("file", "paragraph", "line", "start=REGEX")


@dataclass(frozen=True)
class TextSplit:
    """How a plain-text file is cut into documents (module docstring): `TextSplit.parse("start=^ = ")`."""

    rule: str = "file"  # file | paragraph | line | start
    start: str | None = None  # the regex of rule "start"

    @classmethod
    def parse(cls, spec: str) -> "TextSplit":
        if spec in ("file", "paragraph", "line"):
            return cls(spec)
        if spec.startswith("start="):
            pattern = spec[len("start=") :]
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"--doc-split {spec!r}: the regex does not compile ({e})") from None
            if not pattern:
                raise ValueError("--doc-split 'start=' has no regex: e.g. --doc-split 'start=^ = [^=].* = $'")
            return cls("start", pattern)
        raise ValueError(f"--doc-split {spec!r} is invalid: expected one of {', '.join(TEXT_SPLITS)}")

    def __str__(self) -> str:
        return f"start={self.start}" if self.rule == "start" else self.rule


def is_supported(path: str) -> bool:
    return path.endswith(SUFFIXES)


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
                raise InputError(f"input {p} is not a supported file: expected a name ending in one of {SUFFIXES}")
            out.append(p)
        else:
            raise InputError(f"input {p} does not exist: pass parquet / jsonl(.zst) / txt files or directories")
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

    import pyarrow as pa

    with _open(path) as f:
        try:
            pf = pq.ParquetFile(f)
        except (pa.ArrowException, OSError) as e:
            raise InputError(f"{path} is not a parquet file ({e}); check the file or its name") from None
        names = pf.schema_arrow.names
        if text_column not in names:
            raise InputError(f"{path} has no column {text_column!r} (columns: {names}); pass --text-column")
        kind = pf.schema_arrow.field(text_column).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise InputError(f"{path}: column {text_column!r} holds {kind}, not strings; pass --text-column")
        id_column = next((c for c in ID_COLUMNS if c in names), None)
        row = 0
        try:
            for batch in pf.iter_batches(batch_size=batch_rows):
                for record in batch.to_pylist():
                    doc_id = str(record[id_column]) if id_column else f"{os.path.basename(path)}:{row}"
                    yield record[text_column], doc_id, _meta(record, text_column, id_column)
                    row += 1
        except (pa.ArrowException, OSError) as e:
            raise InputError(f"{path}: row group after row {row} cannot be read ({e}); the file is corrupt") from None


def _lines(path: str):
    """The raw lines (bytes) of a file, zstd-decompressed for .zst / .zstd."""
    import zstandard

    with _open(path) as raw:
        if path.endswith(("zst", "zstd")):
            stream = io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw))
        else:
            stream = raw if isinstance(raw, io.BufferedReader) else io.BufferedReader(raw)  # pyarrow: no readline
        row = 0
        try:
            for line in stream:
                row += 1
                yield row, line
        except zstandard.ZstdError as e:
            raise InputError(f"{path} is not a valid zstd file after line {row} ({e})") from None


def read_jsonl(path: str, text_column: str = "text") -> Iterator[tuple[str | None, str, dict]]:
    for row, raw in _lines(path):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InputError(f"{path} line {row} is not UTF-8 ({e.reason} at byte {e.start} of the line)") from None
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{path} line {row} is not JSON ({e.msg}); the file is corrupt") from None
        if not isinstance(record, dict):
            raise InputError(f"{path} line {row} is a JSON {type(record).__name__}, not an object with {text_column!r}")
        if text_column not in record:
            raise InputError(f"{path} line {row} has no key {text_column!r}; pass --text-column")
        text = record[text_column]
        if text is not None and not isinstance(text, str):
            raise InputError(
                f"{path} line {row}: {text_column!r} is a JSON {type(text).__name__} ({str(text)[:40]}), "
                "not a string; fix the line or pass --text-column"
            )
        id_column = next((c for c in ID_COLUMNS if c in record), None)
        doc_id = str(record[id_column]) if id_column else f"{os.path.basename(path)}:{row - 1}"
        yield text, doc_id, _meta(record, text_column, id_column)


def _first_bad_utf8(path: str) -> str:
    """Where a file stops being UTF-8: `line N (reason at byte B of the line)`."""
    for row, raw in _lines(path):
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as e:
            return f"line {row} ({e.reason} at byte {e.start} of the line)"
    return "a character split across lines"


def read_text(path: str, split: TextSplit = TextSplit()) -> Iterator[tuple[str, str, dict]]:
    """Documents of a UTF-8 plain-text file, cut by `split` (module docstring); ids are `<file name>:<n>`."""
    name = os.path.basename(path)
    start = re.compile(split.start) if split.rule == "start" else None
    n = 0

    def document(lines: list[str]):
        nonlocal n
        text = "".join(lines)
        if split.rule != "file":  # the line end before a separator belongs to the separator
            text = text.removesuffix("\n").removesuffix("\r")
        if text.strip() or (split.rule == "file" and text):
            n += 1
            return (text, f"{name}:{n - 1}", {})
        return None

    with _open(path) as raw:
        lines_in = io.TextIOWrapper(raw, encoding="utf-8", newline="")
        current: list[str] = []
        try:
            for line in lines_in:
                if split.rule == "file":
                    current.append(line)
                    continue
                blank = not line.strip()
                if split.rule == "line":
                    if not blank:
                        doc = document([line])
                        if doc:
                            yield doc
                    continue
                if split.rule == "paragraph" and blank:
                    doc = document(current) if current else None
                    current = []
                    if doc:
                        yield doc
                    continue
                if start is not None and start.match(line.rstrip("\r\n")) and current:
                    doc = document(current)
                    current = []
                    if doc:
                        yield doc
                current.append(line)
        except UnicodeDecodeError:
            raise InputError(f"{path} is not UTF-8 text: {_first_bad_utf8(path)}; convert it to UTF-8") from None
        if current:
            doc = document(current)
            if doc:
                yield doc


def read_documents(
    path: str, text_column: str = "text", text_split: TextSplit = TextSplit()
) -> Iterator[tuple[str | None, str, dict]]:
    """(text, id, meta) for every document of one input file, in file order; text None: a null text."""
    if path.endswith(PARQUET_SUFFIXES):
        return read_parquet(path, text_column)
    if path.endswith(TEXT_SUFFIXES):
        return read_text(path, text_split)
    return read_jsonl(path, text_column)
