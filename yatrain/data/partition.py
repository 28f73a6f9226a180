"""The plan of ``prepare-data --shard I/N``: the corpus cut into N contiguous parts.

The one-machine document order is the input files in order, each file's documents in
order. The plan cuts that sequence at N - 1 points into contiguous parts of about equal
size in bytes (not bin-packed: contiguity is what keeps the order), so concatenating the
parts' documents in part order gives the one-machine order exactly. Cut ``k`` aims at byte
``k x total / N`` of all the files together; inside an uncompressed JSONL file it moves to
the next line start, inside an uncompressed ``.txt`` file to the end of the next blank line
(its documents are blocks between blank lines), inside a parquet file to the nearest
row-group boundary, and inside any other file (compressed, one document per file, not
text) to the nearest end of the file: those are split only at file granularity. With
``--skip-bad-records`` a ``.txt`` file is not split either (reading one stops at its first
line that is not UTF-8, which a later piece could not know). A part may be empty.

The plan depends only on the file list, the files' sizes and the bytes or metadata at the
cut points, so every task computes the same one; its digest, recorded in every part's
manifest, lets the merge check that.
"""

from __future__ import annotations

import bisect
import hashlib
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from yatrain.data.pieces import Piece
from yatrain.data.readers import InputFile, classify

_SEEK_CHUNK = 1 << 16
_BLANK = b" \t\r\f\v\n"  # the whitespace of a blank line between .txt documents


def _units(path: Path, size: int, split_text: bool) -> tuple[str, list[int]]:
    """How ``path`` may be cut: its kind and its cut points as byte offsets (``lines`` and
    ``blocks``: any offset, moved to a line or block start later); ``file``: its two ends."""
    item = classify(path)
    if isinstance(item, InputFile) and item.compression is None:
        if item.fmt == "jsonl":
            return "lines", []
        if item.fmt == "blocks" and split_text:
            return "blocks", []
        if item.fmt == "parquet":
            try:
                meta = pq.ParquetFile(path).metadata
            except (pa.ArrowException, OSError):
                return "file", [0, size]
            if meta.num_row_groups == 0:
                return "file", [0, size]
            weights = [
                max(meta.row_group(g).total_byte_size, 1) for g in range(meta.num_row_groups)
            ]
            total, edges, done = sum(weights), [0], 0
            for w in weights:
                done += w
                edges.append(size * done // total)  # row-group boundaries, scaled to the file
            return "row_groups", edges
    return "file", [0, size]


def _line_start(path: Path, offset: int, size: int) -> int:
    """The first line start at or after ``offset`` (``size`` if none)."""
    if offset <= 0:
        return 0
    with open(path, "rb") as f:
        f.seek(offset - 1)
        position = offset - 1
        while chunk := f.read(_SEEK_CHUNK):
            found = chunk.find(b"\n")
            if found >= 0:
                return position + found + 1
            position += len(chunk)
    return size


def _block_start(path: Path, offset: int, size: int) -> int:
    """The end of the first blank (whitespace-only) line from ``offset``'s next line start
    on (``size`` if none): a document of a ``.txt`` file starts there."""
    position = _line_start(path, offset, size)
    if position in (0, size):
        return position
    with open(path, "rb") as f:
        f.seek(position)
        while line := f.readline():
            position += len(line)
            if not line.strip(_BLANK):
                return position
    return size


def _cut(path: Path, local: int, size: int, split_text: bool) -> tuple[str, int]:
    """Where a cut aimed at byte ``local`` of ``path`` lands, in the file's own units."""
    kind, edges = _units(path, size, split_text)
    if kind == "lines":
        return kind, _line_start(path, local, size)
    if kind == "blocks":
        return kind, _block_start(path, local, size)
    nearest = min(range(len(edges)), key=lambda g: (abs(edges[g] - local), g))
    return kind, nearest if kind == "row_groups" else int(nearest > 0)


def plan_parts(
    files: list[tuple[Path, bool]], parts: int, split_text: bool = True
) -> list[list[Piece]]:
    """The pieces of each of ``parts`` parts, in order (see the module docstring);
    ``split_text``: whether ``.txt`` files may be cut (not when bad records are skipped)."""
    return [part_pieces(files, parts, i, split_text) for i in range(parts)]


def part_pieces(
    files: list[tuple[Path, bool]], parts: int, index: int, split_text: bool = True
) -> list[Piece]:
    """The pieces of part ``index`` of ``parts`` alone: only its two cuts are looked at, so
    a task's plan costs the same for any number of parts. The cuts are monotone in ``k``
    (each lands at or after the one before), so part ``index`` lies between cut ``index``
    and cut ``index + 1`` exactly as in the whole plan."""
    return _between(*part_cuts(files, parts, index, split_text))


def part_cuts(
    files: list[tuple[Path, bool]], parts: int, index: int, split_text: bool = True
) -> tuple[tuple[int, int], tuple[int, int], dict[int, str], dict[int, int]]:
    """Part ``index``'s first and end cut as (file, position in that file's units), with the
    kinds and lengths of the files they fall in."""
    sizes = [path.stat().st_size for path, _ in files]
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + size)
    kinds: dict[int, str] = {}
    ends: dict[int, int] = {}  # a cut file's length in its own units

    def cut(k: int) -> tuple[int, int]:
        if k == 0:
            return (0, 0)
        if k == parts:
            return (len(files), 0)
        target = k * starts[-1] // parts
        f = bisect.bisect_right(starts, target) - 1
        while f < len(files) and sizes[f] == 0:  # zero-size files hold no cut
            f += 1
        if f >= len(files):
            return (len(files), 0)
        kind, position = _cut(files[f][0], target - starts[f], sizes[f], split_text)
        kinds[f], ends[f] = kind, _length(files[f][0], kind, sizes[f])
        return (f, position)

    return cut(index), cut(index + 1), kinds, ends


def _length(path: Path, kind: str, size: int) -> int:
    """A file's length in the units its cuts are counted in."""
    if kind in ("lines", "blocks"):
        return size
    return pq.ParquetFile(path).metadata.num_row_groups if kind == "row_groups" else 1


def _between(
    lo: tuple[int, int], hi: tuple[int, int], kinds: dict[int, str], ends: dict[int, int]
) -> list[Piece]:
    """The pieces from cut ``lo`` to cut ``hi``."""
    pieces = []
    for f in range(lo[0], hi[0] + 1):
        kind = kinds.get(f, "file")
        start = lo[1] if f == lo[0] else 0
        end = hi[1] if f == hi[0] else ends.get(f, 1)
        if end <= start:
            continue
        if kind == "file" or (start == 0 and end == ends[f]):
            pieces.append(Piece(f))
        else:
            pieces.append(Piece(f, kind, start, end))
    return pieces


def plan_sha256(files: list[tuple[Path, bool]], parts: int, split_text: bool) -> str:
    """Identifies the inputs (names, sizes) and the partition: equal on every task of one
    job. (The cuts a task found are recorded in its part and checked by the merge: each
    part must end where the next begins.)"""
    described = {
        "files": [[str(path), path.stat().st_size, explicit] for path, explicit in files],
        "parts": parts,
        "split_text": split_text,
    }
    return hashlib.sha256(json.dumps(described).encode()).hexdigest()
