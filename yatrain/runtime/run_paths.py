"""What a run writes into its directory is its own: folders that are directories, files that
are regular files, never reached through a link.

A run writes into folders of its directory (``hang/``, ``profile/``, ``tensorboard/``,
``wandb/``): one that is a symbolic link would make it write (and delete) among the files
of wherever the link points, and ``mkdir(exist_ok=True)`` follows it without a word, so a
link there, or anything that is not a directory, is refused in one line (``own_folder``).
The files it reads and rewrites (the lock, ``config.yaml``, ``metrics.jsonl``) must be
regular files: opening a FIFO blocks forever and a directory or a device fails with a
traceback, so ``check_regular`` looks first (``lstat``, which opens nothing) and refuses
anything else in one line. ``check_run_paths`` checks them all before a run writes anything.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterable
from pathlib import Path

from yatrain.errors import ConfigError

FOLDERS = ("hang", "profile", "tensorboard", "wandb")  # what a run writes into
FILES = ("config.yaml", "metrics.jsonl", "wandb-run-id")  # what it reads and rewrites
_KINDS = (
    (stat.S_ISLNK, "symbolic link"),
    (stat.S_ISDIR, "directory"),
    (stat.S_ISREG, "file"),
    (stat.S_ISFIFO, "FIFO (named pipe)"),
    (stat.S_ISSOCK, "socket"),
    (stat.S_ISCHR, "character device"),
    (stat.S_ISBLK, "block device"),
)


def kind_of(mode: int) -> str:
    """``file``, ``symbolic link``, ``FIFO (named pipe)``, ...: what an ``lstat`` mode is."""
    return next((name for test, name in _KINDS if test(mode)), "special file")


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def _linked(path: Path) -> ConfigError:
    return ConfigError(
        f"{path} is a symbolic link: yatrain does not write through links in its run "
        "directory; remove the link (what it points to is untouched) and rerun"
    )


def check_folder(path: Path) -> None:
    """``path`` is missing or a directory (not a link to one); else one line."""
    _check_own(path, stat.S_ISDIR, "a directory", "yatrain writes a folder of its own there")


def own_folder(path: Path) -> Path:
    """The directory ``path``, made if missing, never through a link (see the module
    docstring); returns it."""
    check_folder(path)
    try:
        path.mkdir(exist_ok=True)  # the run directory above it exists
    except FileExistsError:  # something appeared there since the check
        check_folder(path)
        raise
    check_folder(path)  # made by another process meanwhile: still a directory of its own
    return path


def check_regular(path: Path) -> None:
    """``path`` is missing or a regular file (not a link, a FIFO, a directory, a device);
    else one line. Opens nothing, so a FIFO never blocks it."""
    why = "yatrain reads and rewrites its own file there"
    _check_own(path, stat.S_ISREG, "a regular file", why)


def _check_own(path: Path, is_kind: Callable[[int], bool], kind: str, why: str) -> None:
    """``path`` is missing or of the ``kind`` its ``lstat`` mode passes ``is_kind`` for; a link
    or anything else is one line."""
    found = _lstat(path)
    if found is None or is_kind(found.st_mode):
        return
    if stat.S_ISLNK(found.st_mode):
        raise _linked(path)
    raise ConfigError(
        f"{path} is a {kind_of(found.st_mode)}, not {kind}: {why}; move it away (or pass "
        "another --run-dir) and rerun"
    )


def check_run_paths(run_dir: Path, files: Iterable[str] = ()) -> None:
    """Every folder a run writes into and every file it reads and rewrites (``FILES`` and
    ``files``) are its own, before it writes anything (see the module docstring)."""
    for name in FOLDERS:
        check_folder(run_dir / name)
    for name in (*files, *FILES):
        check_regular(run_dir / name)
