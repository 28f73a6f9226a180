"""Writing files so that a crash never leaves a half-written one in place."""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path


def crc32(path: Path) -> int:
    """CRC32 of a file, read in chunks."""
    value = 0
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            value = zlib.crc32(chunk, value)
    return value


def write_json_atomic(path: Path, data: dict) -> None:
    """Write ``path`` through a synced temporary file and an atomic rename."""
    tmp = path.with_suffix(".tmp")
    with tmp.open("w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
