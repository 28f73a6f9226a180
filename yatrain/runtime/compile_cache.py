"""Where inductor keeps the code it compiles: never in a run directory, private by default.

Inductor's cache (``TORCHINDUCTOR_CACHE_DIR``: FX graphs and autograd graphs as pickles,
kernels as shared objects, their C++ and Triton sources) is code that a later run loads
and executes. Anyone who can write to it runs code as the next user of it, so it never
lives in a run directory (which people copy, share and hand on) and never where others
can write:

- by default a per-user directory, ``$XDG_CACHE_HOME/yatrain/inductor`` (else
  ``~/.cache/yatrain/inductor``), created 0700; one that is group- or world-writable, or
  owned by another user, is refused in one line;
- ``train.compile_cache: PATH`` names another one, to share compiled code between users
  or nodes on purpose (SHARE_RULE); it may not be inside the run directory nor writable
  by every user (a sticky bit does not help: anyone could still add entries).

Torch creates its own default (``$TMPDIR/torchinductor_$USER``, 0755) the moment inductor
is imported, so ``protect_process`` points the variable at the private directory before
the command line imports anything of torch (even ``yatrain plan``). Where that directory
cannot be used the process gets a fresh private temporary one instead, removed at exit,
and a compiled run is refused in one line saying why (``cache_for_run``).

The variable does not cover everything: torch derives other directories from
``tempfile.gettempdir()`` whatever it says, inductor's precompiled C++ header (included by
every CPU kernel, fixed when inductor is imported, kept if already there) among them, and
its other on-disk caches (``torchinductor_$USER/cache``, ``cache/``). On a shared /tmp
anyone could create them first and plant a header that runs as the next user. So
``protect_process`` also gives the process (and its children: ranks, compiler) a private
temporary directory, ``tmp`` inside the private cache (``TMPDIR``, the one public way to
move them): nothing of torch's defaults is read or written in the shared one. A process
that imported torch before yatrain (a library user, the test suite) keeps its own: torch
has fixed the header's directory by then.
"""

from __future__ import annotations

import atexit
import os
import shutil
import stat
import sys
import tempfile
from pathlib import Path

from yatrain.errors import ConfigError

CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
TEMP_ENV = "TMPDIR"
SHARE_RULE = "a compile cache is code: share it only with people you would let run code as you"


def default_dir() -> Path:
    """The per-user cache: ``$XDG_CACHE_HOME/yatrain/inductor``, else under ``~/.cache``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).absolute() / "yatrain" / "inductor"


def protect_process() -> None:
    """Point inductor at the private cache before torch is imported (see the module doc)."""
    path = _private_or_fresh(default_dir())
    os.environ[CACHE_ENV] = str(path)
    if "torch" not in sys.modules:
        temporary = _private_or_fresh(path / "tmp")
        os.environ[TEMP_ENV] = str(temporary)
        tempfile.tempdir = str(temporary)  # gettempdir() may have cached the shared one


def _private_or_fresh(path: Path) -> Path:
    """``path`` if it is private, else a fresh private temporary directory removed at exit."""
    try:
        return private_dir(path)
    except (ConfigError, OSError):
        fresh = Path(tempfile.mkdtemp(prefix="yatrain-inductor-"))  # 0700, ours
        atexit.register(shutil.rmtree, fresh, ignore_errors=True)
        return fresh


def cache_for_run(explicit: str | None, run_dir: Path) -> Path:
    """The directory a compiled run keeps inductor's code in: ``train.compile_cache`` when
    set, else the private default; ConfigError (one line) for one it must not use."""
    if explicit is None:
        path = default_dir()
        if _inside(path, run_dir):
            raise ConfigError(
                f"the compile cache {path} (the default, under XDG_CACHE_HOME or ~/.cache) is "
                f"inside the run directory {run_dir}, which others may copy or write to: set "
                "XDG_CACHE_HOME outside it, or name a directory with train.compile_cache"
            )
        return private_dir(path)
    if not explicit.strip():  # Path("") is the current directory
        raise ConfigError(
            "train.compile_cache is empty, which would make the current directory the cache: "
            "name a directory, or remove train.compile_cache for the private default"
        )
    path = Path(explicit).expanduser().absolute()
    if _inside(path, run_dir):
        raise ConfigError(
            f"train.compile_cache: {path} is inside the run directory {run_dir}, which others "
            f"may copy or write to ({SHARE_RULE}): name a directory outside it, or remove "
            "train.compile_cache for the private default"
        )
    _create(path, "train.compile_cache")
    if path.stat().st_mode & stat.S_IWOTH:  # sticky or not: anyone could add entries
        raise ConfigError(
            f"train.compile_cache: {path} is writable by every user ({SHARE_RULE}): "
            f"chmod o-w {path}, or remove train.compile_cache for the private default"
        )
    _check_writable(path, "train.compile_cache")
    return path


def _inside(path: Path, run_dir: Path) -> bool:
    return path.resolve().is_relative_to(run_dir.absolute().resolve())


def private_dir(path: Path) -> Path:
    """``path``, created 0700 if missing; ConfigError if others could write to it."""
    _create(path, "the compile cache")
    info = path.stat()
    if info.st_uid != os.getuid():
        raise ConfigError(
            f"the compile cache {path} belongs to user id {info.st_uid}, not to you: its code "
            "would run as you; remove it, or name your own with train.compile_cache"
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ConfigError(
            f"the compile cache {path} is writable by other users (mode "
            f"{stat.S_IMODE(info.st_mode):o}): its code would run as you; chmod 700 {path}, or "
            "remove it"
        )
    _check_writable(path, "the compile cache")
    return path


def _create(path: Path, what: str) -> None:
    """Make ``path`` and any missing parent 0700 (umask aside); one line if it cannot."""
    try:
        for parent in reversed([path, *path.parents]):
            if not parent.exists():
                parent.mkdir(mode=0o700)
        if not path.is_dir():
            raise ConfigError(f"{what} {path} is not a directory: name a directory")
    except OSError as error:
        raise ConfigError(
            f"{what} {path} cannot be created ({error.strerror}): name a writable directory "
            "with train.compile_cache"
        ) from None


def _check_writable(path: Path, what: str) -> None:
    """One line now, rather than inductor's error at the first step (a read-only mount
    refuses even root, whose permission bits ``os.access`` would wave through)."""
    try:
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as error:
        raise ConfigError(
            f"{what} {path} is not writable ({error.strerror}): inductor saves its compiled "
            "code there; make it writable, or name another directory with train.compile_cache"
        ) from None


def use_inductor_cache(path: Path) -> str | None:
    """Point inductor at ``path`` while a run lasts (it reads the variable at each use);
    returns the setting it replaced, for ``restore_inductor_cache``."""
    previous = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = str(path)
    return previous


def restore_inductor_cache(previous: str | None) -> None:
    os.environ.pop(CACHE_ENV, None)
    if previous is not None:
        os.environ[CACHE_ENV] = previous


def cxx_compiler() -> str:
    """The C++ compiler inductor builds CPU kernels with: its ``CXX`` setting, else g++."""
    return os.environ.get("CXX", "g++")
