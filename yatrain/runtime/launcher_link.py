"""What a rank owes the launcher that started it: to die with it, and to hand it its one line.

A launcher (``yatrain pretrain --nproc-per-node``, torchrun) starts each rank in a session of
its own, so a launcher killed with SIGKILL (the out-of-memory killer, a scheduler, a user)
would leave its ranks training as orphans, and on several nodes the other nodes would keep
training with them. ``die_with_launcher`` ties each rank to its launcher: on Linux the kernel
sends the rank SIGKILL when its parent dies (``PR_SET_PDEATHSIG``); elsewhere a thread
watches the parent. The other nodes' ranks then lose a peer and their launchers end non-zero.

``tell_launcher`` writes a failed rank's one line to the error file torch elastic reads
(``TORCHELASTIC_ERROR_FILE``), with its exit code and whether it failed only because another
rank did (a lost peer, a stuck collective): the launcher's summary blames the rank that
failed first (``blame.py``).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

LAUNCHER_PID = "YATRAIN_LAUNCHER_PID"  # set by launch.py for the ranks it starts
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_WATCH_S = 1.0  # how often the thread (not Linux) looks at the parent


def die_with_launcher() -> None:
    """Under a launcher, end this process (SIGKILL) when the launcher ends, also when it
    already has. Nothing outside a launcher."""
    named = os.environ.pop(LAUNCHER_PID, None)  # this rank's children are not its ranks
    if named is not None and named.isascii() and named.isdigit():
        launcher = int(named)
    elif os.environ.get("TORCHELASTIC_RUN_ID") and os.environ.get("LOCAL_RANK"):
        launcher = os.getppid()  # torchrun's agent started this process
    else:
        return
    if not _kernel_kills_orphan():
        threading.Thread(
            target=_watch, args=(launcher,), name="yatrain-parent", daemon=True
        ).start()
    if os.getppid() != launcher:  # it died before this process asked
        os.kill(os.getpid(), signal.SIGKILL)


def tie_to_this_process() -> Callable[[], None]:
    """A ``preexec_fn`` for a child that is not a yatrain rank (a sweep's configuration,
    torchrun's agent): the kernel ends it with SIGKILL when this process dies, as
    ``die_with_launcher`` ends a rank (Linux; elsewhere nothing)."""
    parent = os.getpid()

    def tie() -> None:
        if _kernel_kills_orphan() and os.getppid() != parent:  # died before the child asked
            os.kill(os.getpid(), signal.SIGKILL)

    return tie


def _kernel_kills_orphan() -> bool:
    """Ask Linux for SIGKILL when the parent dies; False where that is not available."""
    if not sys.platform.startswith("linux"):
        return False
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    return False


def _watch(launcher: int) -> None:
    while os.getppid() == launcher:
        time.sleep(_WATCH_S)
    os.kill(os.getpid(), signal.SIGKILL)


def tell_launcher(message: str, code: int, follows_another: bool = False) -> None:
    """Under torch elastic, write this rank's one line, exit code, and whether it failed
    only because another rank did, to the error file its launcher reads."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        report = {
            "message": message,
            "timestamp": int(time.time()),
            "exitcode": code,
            "follows_another": follows_another,
        }
        with contextlib.suppress(OSError):
            Path(path).write_text(json.dumps(report))


def launched() -> bool:
    """Did a launcher start this process: torchrun (or ``--nproc-per-node``), or one that
    names the rendezvous itself (``MASTER_ADDR`` and ``MASTER_PORT``, as with srun)? Read
    from the environment only (the command line asks before torch is imported)."""
    named = "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ
    return "TORCHELASTIC_RUN_ID" in os.environ or named
