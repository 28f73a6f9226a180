"""Every file yatrain writes is whole or not there: one mechanism for all of them.

A file written at once (a report, a table, a manifest, a config) goes to a temporary name
beside it and is renamed over the target only once complete, so a full disk or a crash
leaves the earlier file (or none), never a cut one. A file grown record by record
(``metrics.jsonl``, a sweep's ``results.jsonl``) gets each record in one write; a record
the disk could not take is cut back at once, and a torn tail left by a killed process is
cut back when the file is next opened.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from yatrain.errors import ConfigError


@contextlib.contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """A temporary path beside ``path`` to write; renamed over ``path`` when the block ends
    without an error, removed when it fails."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        with tmp.open("rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as error:
        tmp.unlink(missing_ok=True)
        if error.errno is None:
            raise
        raise OSError(error.errno, error.strerror, str(path)) from None  # the file meant
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_whole(path: Path, data: str | bytes, encoding: str = "utf-8") -> Path:
    """Write ``data`` to ``path`` whole or not at all; returns ``path``."""
    with replacing(path) as tmp:
        if isinstance(data, str):
            tmp.write_text(data, encoding=encoding)
        else:
            tmp.write_bytes(data)
    return path


def make_directory(path: Path, flag: str) -> bool:
    """Make the directory ``path`` that ``flag`` names (True if this call created it); a
    file in the way, at it or above it, is one line."""
    for folder in [path, *path.parents]:
        if folder.exists() and not folder.is_dir():
            raise ConfigError(
                f"{flag} {path}: {folder} is a file, not a directory: pass a directory"
            )
    existed = path.exists()
    path.mkdir(parents=True, exist_ok=True)
    return not existed


def cut_torn_tail(path: Path) -> int:
    """Cut a last line that has no newline (a record a killed writer left half-written);
    returns the bytes removed."""
    if not path.is_file():
        return 0
    with path.open("rb+") as f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return 0
        f.seek(max(0, size - 1))
        if f.read(1) == b"\n":
            return 0
        keep = _end_of_last_line(f, size)
        f.truncate(keep)
        return size - keep


def _end_of_last_line(f, size: int) -> int:
    """The offset just past the last newline of an open file (0 when it has none)."""
    position = size
    while position > 0:
        start = max(0, position - (1 << 16))
        f.seek(start)
        chunk = f.read(position - start)
        found = chunk.rfind(b"\n")
        if found >= 0:
            return start + found + 1
        position = start
    return 0


class RecordFile:
    """A file of text records, one a line, each appended in one write or not at all.

    Opening it cuts a torn tail; a write the disk refuses is cut back to the file's size
    before it, so the file always ends with a whole record."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.torn_bytes = cut_torn_tail(path)
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def append(self, line: str) -> None:
        """Append ``line`` (a newline is added) whole, or raise and leave the file as it was."""
        data = (line.rstrip("\n") + "\n").encode("utf-8")
        before = os.fstat(self.fd).st_size
        try:
            view = memoryview(data)
            while view:
                written = os.write(self.fd, view)
                view = view[written:]
        except OSError as error:
            with contextlib.suppress(OSError):
                os.truncate(self.fd, before)
            raise OSError(error.errno, error.strerror, str(self.path)) from None

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
