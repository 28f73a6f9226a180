"""The documents of a corpus: the embedded default one, or the user's files and directories.

A "document" is the unit that gets wrapped in ``[bos] ... [eos]`` when tokenized, so the
rules decide where the model sees a document boundary (see ``readers``): a JSONL line or a
parquet row, a blank-line-separated block of a ``.txt`` file, or a whole other text file.

Directories are walked recursively in sorted order (hidden entries and ``__pycache__``
skipped), so the same inputs always give the same documents in the same order. A linked
directory inside one is followed, as a linked file is read; a directory reached twice (a
link loop) or one that cannot be listed stops the run with one line. Files in a
directory that are not text (binaries, non-UTF-8) are skipped and listed; a file named
explicitly must be readable. Bad records stop the run with one line naming them, or are
skipped and counted (``skip_bad_records``).
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from yatrain.data.pieces import Piece, read_piece
from yatrain.data.readers import BadRecord, NotText, classify
from yatrain.errors import DataError

# Stdlib directories that are not ordinary library code (tests, vendored tools, caches).
_EXCLUDED_DIRS = {
    "site-packages",
    "dist-packages",
    "test",
    "tests",
    "idlelib",
    "lib2to3",
    "__pycache__",
}
# The one piece of English prose shipped with every CPython: the pydoc help topics.
_PROSE_FILE = "pydoc_data/topics.py"


def default_corpus_files(max_bytes: int = 24_000_000) -> list[Path]:
    """The corpus used when no input is given: this interpreter's own stdlib ``.py`` files.

    It needs no download and is identical on every machine with the same Python version.
    Files are taken in sorted order (prose first) and skipped when they would push the total
    over ``max_bytes``, so a small budget still gives a usable, deterministic slice.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise DataError(f"Python standard library not found at {root}: pass --input files")
    relative = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
        for name in filenames:
            if name.endswith(".py"):
                relative.append(Path(dirpath, name).relative_to(root).as_posix())
    relative.sort()
    if _PROSE_FILE in relative:
        relative.remove(_PROSE_FILE)
        relative.insert(0, _PROSE_FILE)

    files, total = [], 0
    for rel in relative:
        path = root / rel
        size = path.stat().st_size
        if size == 0 or total + size > max_bytes:
            continue
        files.append(path)
        total += size
    return files


def expand_inputs(paths: list[Path]) -> list[tuple[Path, bool]]:
    """Files to read, in order, each with whether it was named explicitly (not found in a
    directory walk)."""
    files: list[tuple[Path, bool]] = []
    for path in map(Path, paths):
        if path.is_dir():
            found = _walk(path)
            found.sort(key=lambda p: p.relative_to(path).as_posix())
            files += [(f, False) for f in found]
        elif path.is_file():
            files.append((path, True))
        else:
            raise DataError(f"input {path} does not exist: check the --input path")
    return files


def _walk(root: Path) -> list[Path]:
    """The files below ``root``, linked directories followed like linked files; a directory
    reached twice (a link loop, or two links to one directory) or one that cannot be listed
    is refused in one line, never skipped."""
    seen: dict[tuple[int, int], Path] = {}
    found: list[Path] = []

    def refuse(error: OSError) -> None:
        raise DataError(
            f"cannot list {error.filename} ({error.strerror}): fix its permissions or move it "
            f"out of --input {root}"
        )

    for dirpath, dirnames, filenames in os.walk(root, onerror=refuse, followlinks=True):
        status = os.stat(dirpath)
        key = (status.st_dev, status.st_ino)
        if key in seen:
            raise DataError(
                f"{dirpath} is the directory {seen[key]} again (a link loop, or two links to "
                f"it): its files would be read twice; remove the link at {dirpath}"
            )
        seen[key] = Path(dirpath)
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "__pycache__"]
        found += [Path(dirpath, f) for f in filenames if not f.startswith(".")]
    return found


@dataclass
class ReadStats:
    """What one pass over a corpus skipped."""

    bad_records: int = 0
    first_bad_record: str | None = None
    not_text: list[tuple[str, str]] = field(default_factory=list)  # (file, why)
    empty_documents: int = 0  # records that held only whitespace (dropped)


class Corpus:
    """Documents of input files and directories (None: the default stdlib corpus); with
    ``pieces``, those of these pieces of its files only (one part of a partitioned corpus)."""

    def __init__(
        self,
        inputs: list[Path] | None = None,
        text_field: str = "text",
        skip_bad_records: bool = False,
        pieces: list[Piece] | None = None,
    ):
        if inputs is not None:
            self.files = expand_inputs(inputs)
        else:
            self.files = [(f, False) for f in default_corpus_files()]
        self.text_field, self.skip_bad_records = text_field, skip_bad_records
        self.pieces = pieces if pieces is not None else [Piece(i) for i in range(len(self.files))]
        self.stats = ReadStats()

    def documents(self) -> Iterator[str]:
        """Every document in order; each call is a new pass with fresh ``stats``."""
        self.stats = stats = ReadStats()
        for piece in self.pieces:
            path, explicit = self.files[piece.index]
            try:
                yield from self._file_documents(path, explicit, stats, piece)
            except OSError as e:
                raise DataError(f"cannot read input {path} ({e.strerror or e}): check it") from None

    def _file_documents(
        self, path: Path, explicit: bool, stats: ReadStats, piece: Piece
    ) -> Iterator[str]:
        item = classify(path)
        if isinstance(item, NotText):
            if not explicit:  # found in a directory: skipped and listed
                stats.not_text.append((str(path), item.reason))
                return
            if item.binary:
                raise DataError(
                    f"input {path} is {item.reason}, not text: pass text, JSONL or parquet "
                    "files (optionally .gz or .zst)"
                )
            where = f"{path}:{item.line}" if item.line > 1 else str(path)
            records = iter([BadRecord(where, f"{item.reason}; re-encode it as UTF-8")])
        else:
            records = read_piece(item, self.text_field, piece)
        for record in records:
            if not isinstance(record, BadRecord):
                if record.strip():
                    yield record
                else:
                    stats.empty_documents += 1
                continue
            message = f"{record.where}: {record.reason}"
            if not self.skip_bad_records:
                raise DataError(
                    f"{message}: fix or remove that record, or pass --skip-bad-records "
                    "to skip and count such records"
                )
            stats.bad_records += 1
            stats.first_bad_record = stats.first_bad_record or message


def iter_documents(paths: list[Path], text_field: str = "text") -> Iterator[str]:
    """The documents of ``paths`` in order (see the module docstring); bad records raise."""
    return Corpus(paths, text_field).documents()
