"""Reading one input file as documents: plain text, JSONL or parquet, optionally gzip/zstd.

What a file is comes from its content: parquet and the compressions by their magic bytes (a
file named ``.gz`` or ``.zst`` that is not compressed so is refused);
text is valid UTF-8 with no NUL byte in its first 8 KiB. The record format inside comes from
the name without the compression suffix: ``.jsonl`` (one ``{"text": ...}`` object per line),
``.txt`` (documents separated by blank lines), anything else one document per file.

Readers stream: JSONL and ``.txt`` line by line, parquet one record batch at a time, so a
file never has to fit in memory (a single document does). A record that cannot be read is
yielded as a ``BadRecord`` naming file and record; the caller stops or skips it.
"""

from __future__ import annotations

import codecs
import gzip
import io
import json
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import zstandard

from yatrain.errors import DataError

SNIFF_BYTES = 8192
_PARQUET_MAGIC, _GZIP_MAGIC, _ZSTD_MAGIC = b"PAR1", b"\x1f\x8b", b"\x28\xb5\x2f\xfd"
_COMPRESSION_SUFFIXES = {".gz": "gzip", ".zst": "zstd"}
_BLANK = " \t\r\f\v\n"
_PARQUET_BATCH_ROWS = 1024
_COMPRESSION_ERRORS = (EOFError, OSError, zlib.error, zstandard.ZstdError)


@dataclass(frozen=True)
class BadRecord:
    """A record that cannot become a document; ``where`` is ``FILE:LINE`` or similar."""

    where: str
    reason: str


@dataclass(frozen=True)
class InputFile:
    path: Path
    fmt: str  # "parquet", "jsonl", "blocks" (.txt), "document" (one per file)
    compression: str | None  # "gzip", "zstd" or None


class _ZstdRaw(io.RawIOBase):
    """Decompressed bytes of a (multi-frame) zstd file; a truncated last frame is an error
    (zstandard's stream reader would end quietly there)."""

    def __init__(self, path: Path):
        self._file = open(path, "rb")  # noqa: SIM115 -- closed in close()
        self._chunks = self._decompress()
        self._pending = b""

    def _decompress(self) -> Iterator[bytes]:
        frame = None
        while data := self._file.read(1 << 20):
            while data:
                frame = frame or zstandard.ZstdDecompressor().decompressobj()
                if out := frame.decompress(data):
                    yield out
                data = frame.unused_data if frame.eof else b""
                frame = None if frame.eof else frame
        if frame is not None:
            raise zstandard.ZstdError("the file ends in the middle of a zstd frame (truncated)")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self._pending:
            self._pending = next(self._chunks, b"")
            if not self._pending:
                return 0
        n = min(len(buffer), len(self._pending))
        buffer[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n

    def close(self) -> None:
        self._file.close()
        super().close()


def open_bytes(path: Path, compression: str | None) -> io.BufferedIOBase:
    """The (decompressed) bytes of ``path`` as a buffered stream."""
    if compression == "gzip":
        return gzip.open(path, "rb")
    if compression == "zstd":
        return io.BufferedReader(_ZstdRaw(path), buffer_size=1 << 16)
    return open(path, "rb")  # noqa: SIM115 -- the caller closes it


@dataclass(frozen=True)
class NotText:
    """Why a file is not text: ``binary`` (a NUL byte) or not UTF-8, and where."""

    binary: bool
    reason: str
    line: int


def not_text(head: bytes, complete: bool) -> NotText | None:
    """Why the first bytes of a file are not UTF-8 text, or None when they are."""
    nul = head.find(b"\0")
    if nul >= 0:
        return NotText(True, f"binary (a NUL byte at offset {nul})", head.count(b"\n", 0, nul) + 1)
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=complete)
    except UnicodeDecodeError as e:
        reason = f"not UTF-8 (byte 0x{head[e.start]:02x} at offset {e.start})"
        return NotText(False, reason, head.count(b"\n", 0, e.start) + 1)
    return None


def classify(path: Path) -> InputFile | NotText:
    """How to read ``path``, or why it is not text -- decided from its content."""
    with open(path, "rb") as f:
        magic = f.read(4)
    name = path.name.lower()
    compression = None
    if magic == _PARQUET_MAGIC:
        return InputFile(path, "parquet", None)
    if magic[:2] == _GZIP_MAGIC:
        compression = "gzip"
    elif magic == _ZSTD_MAGIC:
        compression = "zstd"
    stem, suffix = name.rsplit(".", 1) if "." in name else (name, "")
    named = _COMPRESSION_SUFFIXES.get(f".{suffix}")
    if named is not None and named != compression:
        raise DataError(
            f"{path} is named .{suffix} but is not {named}-compressed (its first bytes are "
            f"{magic!r}): rename it without .{suffix}, or compress it"
        )
    if compression and named == compression:
        name = stem
    if name.endswith(".parquet"):
        why = (
            f"{compression}-compressed parquet is not read (parquet compresses internally)"
            if compression
            else "check the file"
        )
        raise DataError(f"{path} is named .parquet but is not a parquet file: {why}")
    if name.endswith(".json"):
        raise DataError(
            f'{path}: .json files are not read; convert it to JSONL, one {{"text": ...}} '
            "object per line"
        )
    if name.endswith((".jsonl", ".ndjson")):
        fmt = "jsonl"
    elif name.endswith(".txt"):
        fmt = "blocks"
    else:
        fmt = "document"
    try:
        with open_bytes(path, compression) as stream:
            head = stream.read(SNIFF_BYTES)
    except _COMPRESSION_ERRORS:
        if compression is None:
            raise
        return InputFile(path, fmt, compression)  # reading it reports the broken data
    reason = not_text(head, complete=len(head) < SNIFF_BYTES)
    if reason is not None and compression:
        return NotText(reason.binary, f"{compression}-compressed, {reason.reason}", reason.line)
    return reason or InputFile(path, fmt, compression)


def read_documents(item: InputFile, text_field: str) -> Iterator[str | BadRecord]:
    """The documents of one classified file, in order; empty ones are left out."""
    if item.fmt == "parquet":
        yield from _parquet(item.path, text_field)
        return
    try:
        with open_bytes(item.path, item.compression) as stream:
            if item.fmt == "jsonl":
                yield from _jsonl(item.path, stream, text_field)
            elif item.fmt == "blocks":
                yield from _blocks(item.path, stream)
            else:
                yield from _whole(item.path, stream)
    except _COMPRESSION_ERRORS as e:
        if item.compression is None:
            raise
        yield BadRecord(str(item.path), f"broken {item.compression} data ({_first_line(e)})")


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:200] if text else type(error).__name__


def _utf8_reason(e: UnicodeDecodeError, data: bytes) -> str:
    return f"not valid UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start})"


def _jsonl(path: Path, stream, field: str) -> Iterator[str | BadRecord]:
    for lineno, raw in enumerate(stream, start=1):
        where = f"{path}:{lineno}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            yield BadRecord(where, _utf8_reason(e, raw))
            continue
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            yield BadRecord(where, f"invalid JSON ({e.msg})")
            continue
        if not isinstance(record, dict):
            yield BadRecord(where, f"a JSON {type(record).__name__}, not an object")
            continue
        if field not in record:
            keys = ", ".join(list(map(str, record))[:8]) or "none"
            yield BadRecord(where, f'no "{field}" field (its keys: {keys})')
            continue
        text = record[field]
        if not isinstance(text, str):
            kind = "null" if text is None else type(text).__name__
            yield BadRecord(where, f'"{field}" is {kind}, not a string')
            continue
        bad = _surrogate(text)
        if bad is not None:
            yield BadRecord(where, bad)
        else:
            yield text  # whitespace-only documents are dropped (and counted) by the corpus


def _surrogate(text: str) -> str | None:
    """JSON may escape lone UTF-16 surrogates ("\\ud800"), which are not text."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"a lone surrogate \\u{ord(text[e.start]):04x} (not valid Unicode text)"
    return None


def _blocks(path: Path, stream) -> Iterator[str | BadRecord]:
    """Documents separated by blank (whitespace-only) lines; their edge newlines dropped."""
    block: list[str] = []
    for lineno, raw in enumerate(stream, start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            yield BadRecord(f"{path}:{lineno}", _utf8_reason(e, raw))
            return
        if line.strip(_BLANK):
            block.append(line)
        elif block:
            yield "".join(block).strip("\n")
            block = []
    if block:
        yield "".join(block).strip("\n")


def _whole(path: Path, stream) -> Iterator[str | BadRecord]:
    data = stream.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        yield BadRecord(str(path), _utf8_reason(e, data))
        return
    yield text


def _parquet(path: Path, field: str, row_groups: range | None = None) -> Iterator[str | BadRecord]:
    """The rows of ``path`` (of ``row_groups`` only: one piece of a partitioned corpus)."""
    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        yield BadRecord(str(path), f"unreadable parquet ({_first_line(e)})")
        return
    schema = parquet.schema_arrow
    if field not in schema.names:
        columns = ", ".join(schema.names[:12])
        raise DataError(
            f"{path} has no column {field!r} (its columns: {columns}): pass --text-field "
            "with the column that holds the text"
        )
    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise DataError(
            f"{path}: column {field!r} holds {kind}, not strings: pass --text-field with the "
            "column that holds the text"
        )
    first = range(0) if row_groups is None else range(row_groups.start)
    row = sum(parquet.metadata.row_group(g).num_rows for g in first)  # rows before the piece
    try:
        # One thread: this process only has to keep ahead of the tokenizer workers, and
        # an idle Arrow thread pool would be inherited by the workers it forks.
        batches = parquet.iter_batches(
            batch_size=_PARQUET_BATCH_ROWS,
            row_groups=row_groups,
            columns=[field],
            use_threads=False,
        )
        for batch in batches:
            column = batch.column(0)
            try:
                values = column.to_pylist()
            except UnicodeDecodeError:
                values = [_arrow_text(column, i) for i in range(len(column))]
            for text in values:
                row += 1
                if isinstance(text, BadRecord):
                    yield BadRecord(f"{path}: row {row}", text.reason)
                elif text is None:
                    yield BadRecord(f"{path}: row {row}", f"{field!r} is null")
                else:
                    yield text
    except (pa.ArrowException, OSError) as e:
        yield BadRecord(f"{path}: after row {row}", f"unreadable parquet ({_first_line(e)})")


def _arrow_text(column: pa.Array, i: int) -> str | None | BadRecord:
    value = column[i]
    if not value.is_valid:
        return None
    data = value.as_buffer().to_pybytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        return BadRecord("", _utf8_reason(e, data))
