"""A compact index of a data directory's token files, beside its manifest, so that opening
the data costs the same at 20 files and at 300,000.

``manifest.json`` lists every token file (name, token count, SHA-256): 40 MB of JSON for
15T tokens in 300,000 files, which every rank would parse at start-up (0.5 s and 165 MB of
Python objects). ``prepare-data`` and ``--merge`` therefore also write::

    file-index.json                  the manifest without its file lists, and the
                                     fingerprint of the manifest.json it was made from
    file-index.train-ends.npy        int64 end of each training file in the token stream
    file-index.train-names.npy       each file's name, UTF-8 bytes
    file-index.validation-*.npy      the same for the held-out split, when there is one

Ranks memory-map the arrays: a lookup touches a few pages, whatever the file count. The
manifest stays the truth and its format is unchanged: a directory without an index (made
before it, or copied without file times) is read from its manifest as before, and an index
whose fingerprint (the manifest's size, modification time, first and last 64 KiB) does not
match the manifest, or that is unreadable, is ignored the same way. Hashing every token file
(data up to 512 MB, on open) needs the manifest's checksums and reads it.
"""

from __future__ import annotations

import bisect
import hashlib
import io
import json
import os
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from yatrain.data.manifest import MANIFEST, load_manifest, refuse_part, split_entry
from yatrain.files import write_whole

INDEX = "file-index.json"
INDEX_FORMAT = "yatrain-file-index-v1"
_EDGE = 64 * 2**10  # bytes of the manifest's head and tail that its fingerprint hashes


def _array_file(split: str, kind: str) -> str:
    return f"file-index.{split}-{kind}.npy"


# Every name an index may have (what a --shard output's top level may hold besides parts/).
INDEX_FILES = {INDEX} | {
    _array_file(split, kind) for split in ("train", "validation") for kind in ("ends", "names")
}


class FileTable:
    """One split's token files: each one's name and where it ends in the token stream.
    From a manifest: a list and an int64 array in memory; from the index: ``_Column``s."""

    def __init__(self, names: Sequence[str], ends: Sequence[int] | np.ndarray) -> None:
        self._names, self._ends = names, ends

    @classmethod
    def of(cls, files: list[dict]) -> FileTable:
        sizes = np.asarray([entry["num_tokens"] for entry in files], dtype=np.int64)
        return cls([entry["name"] for entry in files], np.cumsum(sizes))

    def __len__(self) -> int:
        return len(self._ends)

    def name(self, index: int) -> str:
        return self._names[index]

    def end(self, index: int) -> int:
        """Where file ``index`` ends (0 for index -1: where the first begins)."""
        return int(self._ends[index]) if index >= 0 else 0

    def locate(self, token: int) -> int:
        """The file that holds token ``token`` of the stream (a binary search: 19 ends read
        at 300,000 files)."""
        return bisect.bisect_right(self._ends, token)


class _Column(Sequence):
    """One 1-D array of an index as a sequence read element by element with ``pread``:
    neither memory nor the process's map count grows with its length (a memory map would
    bring in whole large folios: 2 MB a touch on this machine's kernel). Names come back
    as ``str``, numbers as ``int``."""

    def __init__(self, file: Path) -> None:
        with open(file, "rb") as f:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
            else:
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
            self.offset = f.tell()
        if len(shape) != 1 or fortran or dtype.hasobject:
            raise ValueError(f"{file} is not a flat array")
        self.length, self.dtype = shape[0], dtype
        if file.stat().st_size != self.offset + self.length * dtype.itemsize:
            raise ValueError(f"{file} is truncated")
        self._fd = os.open(file, os.O_RDONLY)  # pread: safe in forked workers too
        weakref.finalize(self, os.close, self._fd)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> Any:  # type: ignore[override]  # never a slice
        size = self.dtype.itemsize
        value = np.frombuffer(os.pread(self._fd, size, self.offset + index * size), self.dtype)[0]
        return bytes(value).decode() if self.dtype.kind == "S" else int(value)


@dataclass
class Indexed:
    """What a current index gives: the manifest without its file lists, and the tables."""

    manifest: dict
    tables: dict[str, FileTable]


def open_manifest(path: Path) -> tuple[dict, Indexed | None]:
    """The data directory's manifest: from its index when that is current (file lists left
    out, ``Indexed`` holding them), else the whole checked ``manifest.json`` and None."""
    indexed = read_file_index(path)
    if indexed is None:
        return load_manifest(path), None
    refuse_part(path, indexed.manifest)
    return indexed.manifest, indexed


def write_file_index(directory: Path, manifest: dict) -> None:
    """Index ``directory``'s manifest (written already); the header goes last, so a killed
    writer leaves no header that names arrays it did not finish."""
    (directory / INDEX).unlink(missing_ok=True)  # an older header never names new arrays
    summary, splits = dict(manifest), {}
    for split in ("train", "validation"):
        part = split_entry(manifest, split)
        if part is None:
            continue
        names = np.array([entry["name"].encode() for entry in part["files"]], dtype=np.bytes_)
        ends = np.cumsum([entry["num_tokens"] for entry in part["files"]], dtype=np.int64)
        for kind, array in (("ends", ends), ("names", names)):
            buffer = io.BytesIO()
            np.save(buffer, array, allow_pickle=False)
            write_whole(directory / _array_file(split, kind), buffer.getvalue())
        splits[split] = len(ends)
        if split == "validation":
            summary["validation"] = {k: v for k, v in part.items() if k != "files"}
    summary.pop("files")
    header = {
        "format": INDEX_FORMAT,
        "manifest": _fingerprint(directory / MANIFEST),
        "files": splits,
        "summary": summary,
    }
    write_whole(directory / INDEX, json.dumps(header, indent=2) + "\n")


def read_file_index(path: Path) -> Indexed | None:
    """The current index of ``path``, or None (none, stale or unreadable: see above)."""
    try:
        header = json.loads((Path(path) / INDEX).read_text())
        if header.get("format") != INDEX_FORMAT:
            return None
        if header["manifest"] != _fingerprint(Path(path) / MANIFEST):
            return None
        manifest, tables = header["summary"], {}
        for split, count in header["files"].items():
            ends = _Column(Path(path) / _array_file(split, "ends"))
            names = _Column(Path(path) / _array_file(split, "names"))
            table = FileTable(names, ends)
            whole = ends.dtype == np.int64 and ends.length == names.length == count > 0
            if not (whole and names.dtype.kind == "S"):
                return None
            if table.end(count - 1) != split_entry(manifest, split)["num_tokens"]:
                return None
            tables[split] = table
        return Indexed(manifest, tables)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _fingerprint(manifest: Path) -> dict:
    """The manifest's size, modification time and a hash of its first and last 64 KiB
    (all of it when small): what an edit changes, read in O(1) of its size."""
    with open(manifest, "rb") as f:
        stat = os.fstat(f.fileno())
        digest = hashlib.sha256(f.read(_EDGE))
        if stat.st_size > _EDGE:
            f.seek(max(_EDGE, stat.st_size - _EDGE))
            digest.update(f.read(_EDGE))
    return {"bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns, "edges_sha256": digest.hexdigest()}
