"""Faults injected into CLI subprocesses: a ``sitecustomize`` module on their PYTHONPATH.

Python imports ``sitecustomize`` at start-up, so the code below runs in every process of a
command (each torchrun worker too) before yatrain does, and patches it the way a real fault
would strike: a rank that hangs or dies at a given step, a disk that fills up during a save.
Nothing in yatrain knows about it.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

_AT_STEP = """
import os, signal, time
if os.environ.get("RANK", "0") == "{rank}":
    import yatrain.data.loader as _loader
    _real = _loader.GlobalBatchLoader.next_batch

    def _next_batch(self):
        if self.step == {step} - 1:  # about to run step {step}
            {action}
        return _real(self)

    _loader.GlobalBatchLoader.next_batch = _next_batch
"""

HANG = "signal.signal(signal.SIGTERM, signal.SIG_DFL)\n            while True: time.sleep(1)"
DIE = "os.kill(os.getpid(), signal.SIGKILL)"

DISK_FULL = """
import errno, os
import yatrain.checkpoint.checksums as _checksum
_real = _checksum.HashingStream.write

def _write(self, data):
    if ".tmp-step-{step}" in self.raw.name:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return _real(self, data)

_checksum.HashingStream.write = _write
"""


def at_step(rank: int, step: int, action: str) -> str:
    """Code that makes ``rank`` run ``action`` (HANG, DIE) just before step ``step``."""
    return _AT_STEP.format(rank=rank, step=step, action=action)


def inject(env: dict, folder: Path, code: str) -> dict:
    """``env`` with ``code`` run at the start of every Python process launched with it."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(textwrap.dedent(code))
    return {**env, "PYTHONPATH": f"{folder}{os.pathsep}{env.get('PYTHONPATH', '')}"}


class FullDisk:
    """A disk that holds ``room`` more bytes under ``folder``, in this process: writes
    through ``open`` (Python's files, matplotlib's, ``Path.write_*``) and ``os.write``
    store what fits, then fail with ENOSPC, as a real full disk does mid-file."""

    def __init__(self, monkeypatch, folder: Path, room: int) -> None:
        import builtins
        import io

        self.folder, self.room = Path(folder).resolve(), room
        real_open, real_write = builtins.open, os.write
        disk = self

        class Filling:
            def __init__(self, file) -> None:
                self._file = file

            def write(self, data):
                return disk.take(data, self._file.write)

            def __getattr__(self, name):
                return getattr(self._file, name)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self._file.close()

            def __iter__(self):
                return iter(self._file)

        def fake_open(file, mode="r", *args, **kwargs):
            opened = real_open(file, mode, *args, **kwargs)
            writing = any(m in mode for m in "wax+") and disk.watches(file)
            return Filling(opened) if writing else opened

        def fake_write(fd, data):
            if disk.watches(os.readlink(f"/proc/self/fd/{fd}")):
                return disk.take(data, lambda part: real_write(fd, part))
            return real_write(fd, data)

        monkeypatch.setattr(builtins, "open", fake_open)
        monkeypatch.setattr(io, "open", fake_open)
        monkeypatch.setattr(os, "write", fake_write)

    def watches(self, file) -> bool:
        return isinstance(file, str | Path) and Path(file).resolve().is_relative_to(self.folder)

    def take(self, data, write):
        """Store what fits of ``data`` through ``write``, then raise ENOSPC."""
        import errno

        size = len(data.encode() if isinstance(data, str) else memoryview(data).cast("B"))
        if size <= self.room:
            self.room -= size
            return write(data)
        fits, self.room = self.room, 0
        if fits:
            write(data[:fits])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
