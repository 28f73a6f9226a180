"""One piece of one input file: what a part of a partitioned corpus reads (see ``partition``).

A piece is a whole file, a range of whole lines of an uncompressed JSONL file (byte offsets
that are line starts), a range of whole blank-line-separated documents of an uncompressed
``.txt`` file, or a range of a parquet file's row groups. Reading the pieces of a
file one after the other gives exactly the documents and bad records of reading it whole,
in the same order and named at the same line or row.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from yatrain.data.readers import BadRecord, InputFile, _blocks, _jsonl, _parquet, read_documents

KINDS = ("file", "lines", "blocks", "row_groups")
_COUNT_CHUNK = 1 << 22


@dataclass(frozen=True)
class Piece:
    """File ``index`` of the corpus's file list, whole or ``[start, end)`` of its bytes
    (``lines``, ``blocks``) or of its row groups (``row_groups``)."""

    index: int
    kind: str = "file"
    start: int = 0
    end: int = 0

    def to_json(self) -> list:
        return [self.index, self.kind, self.start, self.end]


def read_piece(item: InputFile, text_field: str, piece: Piece) -> Iterator[str | BadRecord]:
    """The documents (and bad records) of one piece of the classified file ``item``."""
    if piece.kind == "row_groups":
        yield from _parquet(item.path, text_field, range(piece.start, piece.end))
    elif piece.kind in ("lines", "blocks"):
        yield from _line_range(item.path, text_field, piece)
    else:
        yield from read_documents(item, text_field)


def _lines(path: Path, start: int, end: int) -> Iterator[bytes]:
    with open(path, "rb") as f:
        f.seek(start)
        left = end - start
        while left > 0 and (raw := f.readline()):
            left -= len(raw)
            yield raw


def _line_range(path: Path, field: str, piece: Piece) -> Iterator[str | BadRecord]:
    """The JSONL records or ``.txt`` documents of bytes ``[start, end)``; a bad one named at
    its line in the whole file."""
    start = piece.start
    lines = _lines(path, start, piece.end)
    records = _jsonl(path, lines, field) if piece.kind == "lines" else _blocks(path, lines)
    before = None
    for record in records:
        if isinstance(record, BadRecord) and start > 0:
            before = _newlines(path, start) if before is None else before  # only on errors
            line = int(record.where.rsplit(":", 1)[1])
            record = BadRecord(f"{path}:{line + before}", record.reason)
        yield record


def _newlines(path: Path, end: int) -> int:
    """Line breaks in the first ``end`` bytes of ``path``."""
    count = 0
    with open(path, "rb") as f:
        while end > 0 and (chunk := f.read(min(_COUNT_CHUNK, end))):
            count += chunk.count(b"\n")
            end -= len(chunk)
    return count
