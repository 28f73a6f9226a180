"""Reading raw documents: the embedded default corpus and the user's text/JSONL files.

A "document" is the unit that gets wrapped in ``[bos] ... [eos]`` when tokenized, so the
rules here decide where the model sees a document boundary:

- ``.jsonl``: one document per line, taken from the line's ``"text"`` field;
- ``.txt`` with blank-line-separated blocks: one document per block;
- anything else (``.py``, ``.md``, a ``.txt`` without blank lines...): one document per file.

Directories are walked recursively in sorted order (hidden entries and ``__pycache__``
skipped), so the same inputs always give the same documents in the same order.
"""

import json
import os
import re
import sysconfig
from collections.abc import Iterator
from pathlib import Path

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
_BLANK_LINES = re.compile(r"\n[ \t\r\f\v]*\n")


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


def expand_inputs(paths: list[Path]) -> list[Path]:
    """Turn files and directories into the sorted list of files to read."""
    files = []
    for path in map(Path, paths):
        if path.is_dir():
            found = []
            for dirpath, dirnames, filenames in os.walk(path):
                dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "__pycache__"]
                found += [Path(dirpath, f) for f in filenames if not f.startswith(".")]
            files += sorted(found, key=lambda p: p.relative_to(path).as_posix())
        elif path.is_file():
            files.append(path)
        else:
            raise DataError(f"input {path} does not exist: check the --input path")
    return files


def iter_documents(paths: list[Path]) -> Iterator[str]:
    """Yield the documents of ``paths`` in order, skipping empty ones (see module docstring)."""
    for path in expand_inputs(paths):
        suffix = path.suffix.lower()
        if suffix == ".jsonl":
            yield from _jsonl_documents(path)
        elif suffix == ".json":
            raise DataError(
                f"{path}: .json files are not read; convert it to JSONL, one "
                '{"text": ...} object per line'
            )
        elif suffix == ".txt":
            for block in _BLANK_LINES.split(_read_text(path)):
                block = block.strip("\n")
                if block.strip():
                    yield block
        else:
            text = _read_text(path)
            if text.strip():
                yield text


def _read_text(path: Path) -> str:
    # Replace undecodable bytes instead of failing: one bad byte should not stop a long run.
    return path.read_bytes().decode("utf-8", errors="replace")


def _jsonl_documents(path: Path) -> Iterator[str]:
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{path}:{lineno}: invalid JSON ({e.msg}); fix or drop that line"
                ) from None
            text = record.get("text") if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise DataError(
                    f'{path}:{lineno}: expected an object with a string "text" field; '
                    "fix or drop that line"
                )
            if text.strip():
                yield text
