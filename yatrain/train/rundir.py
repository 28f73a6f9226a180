"""Where a run lives, and the lock that keeps it to one run at a time.

The default run directory must be the same for every rank and every restart of an elastic
torchrun job, so under torchrun it is named after the job's rendezvous id; a plain run gets
``runs/RECIPE-TIME``, made unique by creating it (``-2``, ``-3``, ... when two runs start in
the same second). A run holds an exclusive ``flock`` on ``RUN_DIR/.yatrain.lock`` from before
it writes anything until it exits: a second run on the same directory is refused with one
line naming the holder (its PID and host are written into the file). The kernel releases
the lock when the holder exits in any way, a crash or SIGKILL included, so a stale lock
never blocks a restart.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from yatrain.errors import ConfigError

LOCK_FILE = ".yatrain.lock"


def run_dir_for(resume: str, run_dir: Path | None, recipe_name: str, ckpt_dirname: str) -> Path:
    """The run directory: given, or the run that holds ``--resume PATH``, or a new default
    one (created here, so that it is unique)."""
    if run_dir is not None:
        return run_dir
    if resume not in ("auto", "never"):
        path = Path(resume)
        if path.parent.name == ckpt_dirname:
            return path.parent.parent
    return default_run_dir(recipe_name)


def default_run_dir(recipe_name: str, root: Path = Path("runs")) -> Path:
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id and run_id != "none":
        return root / f"{recipe_name}-{run_id}"  # shared by the job's ranks and restarts
    base = f"{recipe_name}-{time.strftime('%Y%m%d-%H%M%S')}"
    root.mkdir(parents=True, exist_ok=True)
    for number in range(1, 10_000):
        path = root / (base if number == 1 else f"{base}-{number}")
        with contextlib.suppress(FileExistsError):
            path.mkdir()  # atomic: of two runs started together, one gets each name
            return path
    raise ConfigError(f"no free run directory name under {root}/{base}: pass --run-dir")


def check_run_dir(run_dir: Path) -> None:
    """A usable directory path (before anything is built)."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"--run-dir {run_dir} is a file, not a directory: pass a directory")


def check_fresh_start_allowed(run_dir: Path, resume: str) -> None:
    if resume == "never" and (run_dir / "metrics.jsonl").exists():
        raise ConfigError(
            f"run directory {run_dir} already holds a run (metrics.jsonl) and --resume is never: "
            "pass another --run-dir, use --resume auto, or delete it"
        )


class RunDirLock:
    """The exclusive lock on a run directory (see the module docstring)."""

    def __init__(self, run_dir: Path) -> None:
        check_run_dir(run_dir)
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            self.fd: int | None = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:
            raise ConfigError(
                f"cannot use {run_dir} as the run directory ({error.strerror}): pass another "
                "--run-dir"
            ) from None
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._holder()
            self.release()
            raise ConfigError(
                f"run directory {run_dir} is in use by another run ({holder}): wait for it to "
                "finish or stop it, or pass another --run-dir"
            ) from None
        me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, json.dumps(me).encode(), 0)

    def _holder(self) -> str:
        try:
            info = json.loads(os.pread(self.fd, 4096, 0) or b"{}")
            since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["since"]))
            return f"PID {info['pid']} on {info['host']}, since {since}"
        except (OSError, ValueError, KeyError, TypeError):
            return "holder unknown"

    def release(self) -> None:
        """Let the next run in (also done by the kernel when this process exits)."""
        if self.fd is not None:
            os.close(self.fd)  # closing the only descriptor releases the flock
            self.fd = None
