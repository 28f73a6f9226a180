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
