"""Where a run lives, and the lock that keeps it to one run at a time.

The default run directory must be the same for every rank and every restart of an elastic
torchrun job, so under torchrun it is named after the job's rendezvous id; a plain run gets
``runs/RECIPE-TIME``, made unique by creating it (``-2``, ``-3``, ... when two runs start in
the same second). A run holds an exclusive ``flock`` on ``RUN_DIR/.yatrain.lock`` from before
it writes anything until it exits: a second run on the same directory is refused with one
line naming the holder (its PID and host are written into the file). The kernel releases
the lock when the holder exits in any way, a crash or SIGKILL included, so a stale lock
never blocks a restart.

A directory that is not empty and holds no lock file is not a yatrain run and is refused
(a run would overwrite its ``config.yaml``). A ``checkpoint.dir`` outside the run directory
is locked with it and records its owner (``.yatrain-owner``): a run never resumes from or
prunes a checkpoint directory another run owns (``--resume PATH`` reads one explicitly).
A run that fails to start leaves nothing behind: its lock file goes, and so does the run
directory when nothing else is in it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import stat
import time
from pathlib import Path

from yatrain.checkpoint.manifest import complete_checkpoints
from yatrain.errors import ConfigError
from yatrain.files import open_fd, write_whole
from yatrain.runtime.hang import next_attempt, use_attempt
from yatrain.runtime.launch import check_run_id
from yatrain.runtime.process import Runtime, elastic_run_id
from yatrain.runtime.run_paths import check_regular, check_run_paths

LOCK_FILE = ".yatrain.lock"
OWNER_FILE = ".yatrain-owner"  # in a checkpoint.dir outside its run: the run that owns it


def run_dir_for(resume: str, run_dir: Path | None, recipe_name: str, ckpt_dirname: str) -> Path:
    """The run directory: given, or the run that holds ``--resume PATH``, or a new default
    one (created here, so that it is unique)."""
    if resume not in ("auto", "never"):
        check_resume_path(Path(resume), ckpt_dirname)
    if run_dir is not None:
        return run_dir
    if resume not in ("auto", "never"):
        path = Path(resume)
        if path.parent.name == ckpt_dirname and (path.parent.parent / LOCK_FILE).exists():
            return path.parent.parent
    return default_run_dir(recipe_name)


def check_resume_path(path: Path, ckpt_dirname: str) -> None:
    """``--resume`` names a checkpoint, not a run directory (say how to continue one)."""
    if (path / LOCK_FILE).exists():
        checkpoints = path / ckpt_dirname
        newest = complete_checkpoints(checkpoints)
        example = newest[0] if newest else checkpoints / "step-N"
        raise ConfigError(
            f"--resume {path} is a run directory, not a checkpoint: continue that run with "
            f"--run-dir {path} --resume auto, or name one of its checkpoints (--resume {example})"
        )


def default_run_dir(recipe_name: str, root: Path = Path("runs")) -> Path:
    run_id = elastic_run_id()
    if run_id is not None:
        check_run_id(run_id, "--rdzv-id")  # torchrun's: a name, never a path out of runs/
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


def check_is_run_dir(run_dir: Path) -> None:
    """Refuse a non-empty directory that no yatrain run made (it has neither a lock file
    nor, from a yatrain before the lock, a metrics.jsonl)."""
    marks = (run_dir / LOCK_FILE, run_dir / "metrics.jsonl")
    if run_dir.is_dir() and not any(m.exists() for m in marks) and any(run_dir.iterdir()):
        raise ConfigError(
            f"--run-dir {run_dir} is not empty and is not a yatrain run directory (no "
            f"{LOCK_FILE}): pass a new or empty directory"
        )


def outside(checkpoint_dir: Path, run_dir: Path) -> bool:
    """Whether ``checkpoint_dir`` (absolute, or relative to the run) leaves the run directory."""
    inner = (run_dir / checkpoint_dir).resolve()
    return not inner.is_relative_to(run_dir.resolve())


def check_fresh_start_allowed(run_dir: Path, resume: str) -> None:
    if resume == "never" and (run_dir / "metrics.jsonl").exists():
        raise ConfigError(
            f"run directory {run_dir} already holds a run (metrics.jsonl) and --resume is never: "
            "pass another --run-dir, use --resume auto, or delete it"
        )


class RunDirLock:
    """The exclusive lock on a run directory (see the module docstring)."""

    def __init__(self, run_dir: Path, checkpoint_dir: Path | None = None) -> None:
        check_run_dir(run_dir)
        check_is_run_dir(run_dir)
        check_run_paths(run_dir, [LOCK_FILE])  # before anything is written (run_paths.py)
        self.run_dir, self.fd, self.owned_fd = run_dir, _lock(run_dir, "run directory"), None
        self.owned = None  # a checkpoint.dir outside the run directory
        if checkpoint_dir is not None and outside(checkpoint_dir, run_dir):
            self.owned = run_dir / checkpoint_dir
            try:
                self.owned_fd = _claim_checkpoint_dir(self.owned, run_dir)
            except BaseException:
                self.release(started=False)
                raise

    def deleted(self) -> bool:
        """Whether the run directory was deleted or moved while the run held it: its lock
        file is no longer the one this run holds."""
        if self.fd is None:
            return False
        try:
            there = os.stat(self.run_dir / LOCK_FILE)
        except FileNotFoundError:
            return True
        except OSError:
            return False  # a file system hiccup is not a deletion
        held = os.fstat(self.fd)
        return (there.st_ino, there.st_dev) != (held.st_ino, held.st_dev)

    def release(self, started: bool = True) -> None:
        """Let the next run in (also done by the kernel when this process exits). A run
        that did not start (``started=False``) removes its lock file, and the run directory
        when nothing else is in it."""
        if not started and self.fd is not None:
            _remove_if_unused(self.run_dir, {LOCK_FILE})
            if self.owned_fd is not None:
                _remove_if_unused(self.owned, {LOCK_FILE, OWNER_FILE})
        for fd in (self.fd, self.owned_fd):
            if fd is not None:
                os.close(fd)  # closing the only descriptor releases the flock
        self.fd = self.owned_fd = None


def _remove_if_unused(folder: Path, ours: set[str]) -> None:
    """Remove ``folder`` when it holds only our bookkeeping files ``ours``."""
    with contextlib.suppress(OSError):
        if {p.name for p in folder.iterdir()} <= ours:
            for name in ours:
                (folder / name).unlink(missing_ok=True)
            folder.rmdir()


def _lock(folder: Path, what: str) -> int:
    """An exclusive flock on ``folder/.yatrain.lock`` (created with the folder, never
    through a link), holding this process's PID and host; one line naming the holder when
    another run has it."""
    other = "--run-dir" if what == "run directory" else "checkpoint.dir"
    check_regular(folder / LOCK_FILE)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = open_fd(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK)
    except OSError as error:
        raise ConfigError(
            f"cannot use {folder} as the {what} ({error.strerror}): pass another {other}"
        ) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # replaced since the check: never blocks
        os.close(fd)
        check_regular(folder / LOCK_FILE)
        raise ConfigError(f"{folder / LOCK_FILE} is not a regular file: move it away and rerun")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise ConfigError(
            f"{what} {folder} is in use by another run ({holder}): wait for it to finish or "
            f"stop it, or pass another {other}"
        ) from None
    me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(me).encode(), 0)
    return fd


def _holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["since"]))
        return f"PID {info['pid']} on {info['host']}, since {since}"
    except (OSError, ValueError, KeyError, TypeError):
        return "holder unknown"


def _claim_checkpoint_dir(folder: Path, run_dir: Path) -> int:
    """Lock a checkpoint directory outside its run and make sure this run owns it: one
    that records another owner, or holds checkpoints no run claims, is refused, and left
    as it was (a lock file this call made would pass it for a run directory later)."""
    made_lock = not os.path.lexists(folder / LOCK_FILE)
    fd = _lock(folder, "checkpoint directory")
    try:
        return _check_owner(fd, folder, run_dir)
    except BaseException:
        if made_lock:  # removed while still held: no other run can have taken it
            with contextlib.suppress(OSError):
                (folder / LOCK_FILE).unlink()
        os.close(fd)
        raise


def _check_owner(fd: int, folder: Path, run_dir: Path) -> int:
    """``fd`` when this run owns ``folder`` (recorded now if nobody did); else one line."""
    me, owner_file = str(run_dir.resolve()), folder / OWNER_FILE
    check_regular(owner_file)
    try:
        owner = json.loads(owner_file.read_text())["run_dir"] if owner_file.exists() else None
    except (OSError, ValueError, KeyError, TypeError):
        owner = "an unreadable owner"
    others = [p.name for p in folder.iterdir() if p.name not in (LOCK_FILE, OWNER_FILE)]
    if owner is None and others:
        raise ConfigError(
            f"checkpoint.dir {folder} holds files but no {OWNER_FILE} naming the run that owns "
            "it: set another checkpoint.dir (and --resume DIR/step-N to start from one), or, "
            f'if it is this run\'s (an older yatrain\'s), write {{"run_dir": "{me}"}} into '
            f"{folder / OWNER_FILE}"
        )
    if owner is not None and owner != me:
        raise ConfigError(
            f"checkpoint.dir {folder} belongs to {owner}, not to this run ({me}): set "
            "another checkpoint.dir (to start from one of its checkpoints, pass --resume "
            f"{folder}/step-N)"
        )
    if owner is None:
        write_whole(owner_file, json.dumps({"run_dir": me}) + "\n")
    return fd


def claim_run_dir(
    runtime: Runtime, resume: str, run_dir: Path | None, recipe_name: str, ckpt_dirname: str
) -> tuple[Path, RunDirLock | None]:
    """Rank 0 picks the run directory and locks it (and a checkpoint directory outside it);
    every rank gets the path, or the same one-line error (a file in the way, another run
    holding it or the checkpoint directory, a directory that is not a run, a link or a FIFO
    where the run writes), and the number of this attempt (``hang.use_attempt``)."""
    answer: object = None
    lock = None
    if runtime.is_main:
        try:
            path = run_dir_for(resume, run_dir, recipe_name, ckpt_dirname)
            check_run_dir(path)
            lock = RunDirLock(path, Path(ckpt_dirname))
            check_fresh_start_allowed(path, resume)
            answer = (str(path), next_attempt(path))
        except ConfigError as error:
            if lock is not None:
                lock.release(started=False)
                lock = None
            answer = error
    answer = runtime.broadcast_object(answer)
    if isinstance(answer, ConfigError):
        raise answer
    path, attempt = answer
    use_attempt(Path(path), attempt)  # this attempt's hang evidence: hang/attempt-N/
    return Path(path), lock
