"""Every file yatrain writes is whole or not there: one mechanism for all of them.

A file written at once (a report, a table, a manifest, a config) goes to a temporary name
beside it and is renamed over the target only once complete, so a full disk or a crash
leaves the earlier file (or none), never a cut one. A file grown record by record
(``metrics.jsonl``, a sweep's ``results.jsonl``) gets each record in one write; a record
the disk could not take is cut back at once, and a torn tail left by a killed process is
cut back when the file is next opened.

Nothing yatrain writes in a run directory, a checkpoint directory or a sweep's output
follows a symbolic link at the file's own name: a file is opened with ``O_NOFOLLOW``
(``no_follow``, ``open_fd``) or replaced by rename (``replacing``), so a link planted there
never makes yatrain truncate or overwrite the file it points to. The directories on the way
may be links (``runs -> /scratch/runs``).
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from yatrain.errors import ConfigError


def open_fd(path: Path, flags: int, mode: int = 0o644) -> int:
    """``os.open`` that never follows a symbolic link at ``path`` itself: a link there is
    refused in one line naming it (its target is left alone)."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as error:
        if error.errno == errno.ELOOP and os.path.islink(path):
            raise ConfigError(
                f"{path} is a symbolic link: yatrain does not write through links in its "
                "directories; remove the link (what it points to is untouched) and rerun"
            ) from None
        raise


def no_follow(path: str | os.PathLike, flags: int) -> int:
    """An ``opener`` for ``open()`` (``open(path, "w", opener=no_follow)``): ``open_fd``."""
    return open_fd(Path(path), flags)


def _exclusive(path: str | os.PathLike, flags: int) -> int:
    return open_fd(Path(path), flags | os.O_EXCL)


def touch(path: Path) -> None:
    """Create ``path`` if missing (never through a link)."""
    os.close(open_fd(path, os.O_WRONLY | os.O_CREAT))


@contextlib.contextmanager
def replacing(path: Path) -> Iterator[BinaryIO]:
    """A new file beside ``path`` to write (binary); renamed over ``path`` when the block
    ends without an error (a link at ``path`` is replaced, not followed), removed when it
    fails."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)  # a stale one (a killed process had this PID): gone, never followed
        with open(tmp, "wb", opener=_exclusive) as f:
            yield f
            f.flush()
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
    with replacing(path) as f:
        f.write(data.encode(encoding) if isinstance(data, str) else data)
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
    returns the bytes removed (nothing when there is no file)."""
    try:
        fd = open_fd(path, os.O_RDWR)
    except FileNotFoundError:
        return 0
    try:
        return _cut_torn_tail(fd)
    finally:
        os.close(fd)


def _cut_torn_tail(fd: int) -> int:
    size = os.fstat(fd).st_size
    if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
        return 0
    keep = _end_of_last_line(fd, size)
    os.ftruncate(fd, keep)
    return size - keep


def _end_of_last_line(fd: int, size: int) -> int:
    """The offset just past the last newline of an open file (0 when it has none)."""
    position = size
    while position > 0:
        start = max(0, position - (1 << 16))
        chunk = os.pread(fd, position - start, start)
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
        self.fd = open_fd(path, os.O_RDWR | os.O_APPEND | os.O_CREAT)
        try:
            self.torn_bytes = _cut_torn_tail(self.fd)
        except BaseException:
            self.close()
            raise

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
