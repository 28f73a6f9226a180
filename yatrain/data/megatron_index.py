"""The checks of a Megatron-LM ``.idx`` (see ``yatrain.data.megatron`` for the format) made
before anything is mapped: the header against the two files' lengths, and the sequences
tiling the ``.bin`` in order, read from the files a bounded chunk at a time.

The sizes of those chunks and of the read windows are the reader's settings
(``yatrain.data.megatron``), passed in, so that they are set (and shrunk by tests) in one
place.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import BinaryIO

import numpy as np

from yatrain.errors import DataError

MAGIC = b"MMIDIDX\x00\x00"
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequences, document indices
DTYPES = {1: "u1", 2: "i1", 3: "<i2", 4: "<i4", 5: "<i8", 8: "<u2"}  # token ids: integers
_FLOATS = {6: "float64", 7: "float32"}


def invalid_index(prefix: Path, problem: str) -> DataError:
    """The error for an ``.idx`` with ``problem``, saying what to do about it."""
    return DataError(
        f"Megatron index {prefix}.idx {problem}: it is not a valid Megatron-LM indexed "
        "dataset for its .bin; rebuild the pair (preprocess_data.py) or point at another prefix"
    )


class FileArray:
    """An array at byte ``offset`` of an open file, read with file reads: unlike pages touched
    through a map, which count in the process's memory, nothing read stays resident."""

    def __init__(self, file: BinaryIO, dtype, offset: int, window: int):
        self.file, self.dtype, self.offset = file, np.dtype(dtype), offset
        self.window = window  # bytes read at once to pick scattered entries out of the file

    def slice(self, lo: int, hi: int) -> np.ndarray:
        """Entries ``[lo, hi)``."""
        self.file.seek(self.offset + lo * self.dtype.itemsize)
        return np.fromfile(self.file, dtype=self.dtype, count=hi - lo)

    def __getitem__(self, places: np.ndarray) -> np.ndarray:
        """The entries at ``places`` (ascending): one read per ``window`` bytes that holds
        some, so scattered places cost neither a read each nor the whole span."""
        out = np.empty(len(places), dtype=self.dtype)
        if not len(places):
            return out
        window = (places - places[0]) // max(1, self.window // self.dtype.itemsize)
        cuts = (np.flatnonzero(np.diff(window)) + 1).tolist()
        for lo, hi in zip([0, *cuts], [*cuts, len(places)], strict=True):
            first = int(places[lo])
            out[lo:hi] = self.slice(first, int(places[hi - 1]) + 1)[places[lo:hi] - first]
        return out


def read_header(prefix: Path, idx: Path) -> tuple[np.dtype, int, int]:
    """The token dtype, the sequence count S and the document index count D, once the header
    is valid and the ``.idx`` has the size it implies."""
    size = idx.stat().st_size
    if size < HEADER.size:
        raise invalid_index(prefix, f"has {size} bytes, fewer than its {HEADER.size}-byte header")
    with open(idx, "rb") as f:
        magic, version, code, sequences, entries = HEADER.unpack(f.read(HEADER.size))
    if magic != MAGIC:
        raise invalid_index(prefix, f"starts with {magic!r}, not {MAGIC!r}")
    if version != 1:
        raise invalid_index(prefix, f"has version {version}; version 1 is the one read")
    if code not in DTYPES:
        kind = f"{_FLOATS[code]}, not token ids" if code in _FLOATS else "unknown"
        raise invalid_index(prefix, f"has dtype code {code} ({kind})")
    body = sequences * 12 + entries * 8
    if entries < 1 or size not in (HEADER.size + body, HEADER.size + body + sequences):
        raise invalid_index(
            prefix,
            f"has {size} bytes, but its header ({sequences:,} sequences, {entries:,} document "
            f"index entries) needs {HEADER.size + body} (or {sequences:,} more with modes)",
        )
    return np.dtype(DTYPES[code]), sequences, entries


def check_sequences(
    prefix: Path,
    lengths: FileArray,
    pointers: FileArray,
    sequences: int,
    itemsize: int,
    bin_bytes: int,
    chunk: int,
) -> None:
    """The lengths are non-negative and the pointers lay the sequences end to end over the
    whole ``.bin`` (``chunk`` of them in memory at a time)."""
    done = 0
    for lo in range(0, sequences, chunk):
        hi = min(lo + chunk, sequences)
        part = lengths.slice(lo, hi).astype(np.int64)
        if int(part.min()) < 0:
            raise invalid_index(prefix, f"has a negative sequence length ({int(part.min())})")
        ends = done + np.cumsum(part)
        expected = (ends - part) * itemsize
        found = pointers.slice(lo, hi)
        wrong = np.flatnonzero(found != expected)
        if len(wrong):
            first = int(wrong[0])
            raise invalid_index(
                prefix,
                f"points sequence {lo + first} at byte {int(found[first])}, not "
                f"{int(expected[first])} (sequences must follow each other in the .bin)",
            )
        done = int(ends[-1])
    if done * itemsize != bin_bytes:
        raise invalid_index(
            prefix,
            f"describes {done * itemsize:,} bytes of tokens, but the .bin has {bin_bytes:,}",
        )


def check_document_index(
    prefix: Path, entries: np.ndarray, first: bool, last: bool, sequences: int
) -> None:
    """A chunk of the document index (its ``first`` and/or ``last`` chunk) runs
    monotonically from 0 up to the sequence count S, as the whole index must."""
    if (
        (first and entries[0] != 0)
        or entries[-1] > sequences
        or (last and entries[-1] != sequences)
        or np.any(np.diff(entries) < 0)
    ):
        raise invalid_index(
            prefix, f"has a document index that does not run from 0 up to {sequences}"
        )
