"""Writing files so that a crash never leaves a half-written one in place."""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

from yatrain.files import write_whole


def crc32(path: Path) -> int:
    """CRC32 of a file, read in chunks."""
    value = 0
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            value = zlib.crc32(chunk, value)
    return value


def write_json_atomic(path: Path, data: dict) -> None:
    """Write ``path`` whole or not at all (``yatrain.files``)."""
    write_whole(path, json.dumps(data, indent=1))


def fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
