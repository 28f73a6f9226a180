"""Hangs end: a distributed run stuck in one step or save for too long stops with one line.

A rank that hangs (a deadlocked kernel, a stopped process) leaves its peers waiting in a
collective forever, and NCCL's own timeout aborts the process without a word on where it
was. The loop tells the watchdog what it is doing (``phase("step 12")``); a daemon thread
checks every few seconds and, when one phase has lasted ``train.collective_timeout_s``,
prints one line naming the step and this rank and ends the process (the run directory's
lock goes with it; ``--resume auto`` continues from the last checkpoint). The process
group's own timeout is set a minute later, as a backstop.
"""

from __future__ import annotations

import os
import sys
import threading
import time

EXIT_CODE = 3  # a stuck collective (2: a user error, 130: stopped by a signal)


class Watchdog:
    """See the module docstring; inactive (no thread) in a single process."""

    def __init__(self, timeout_s: float, rank: int, active: bool) -> None:
        self.timeout_s, self.rank = timeout_s, rank
        self._phase: str | None = None
        self._since = time.monotonic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        if active:
            self._thread = threading.Thread(target=self._watch, name="yatrain-watchdog",
                                            daemon=True)  # fmt: skip
            self._thread.start()

    def phase(self, what: str | None) -> None:
        """What the run is doing from now on (None: nothing to watch)."""
        with self._lock:
            self._phase, self._since = what, time.monotonic()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _watch(self) -> None:
        interval = min(5.0, max(self.timeout_s / 5, 0.1))
        while not self._stop.wait(interval):
            with self._lock:
                phase, waited = self._phase, time.monotonic() - self._since
            if phase is not None and waited >= self.timeout_s:
                self._stop_process(phase, waited)

    def _stop_process(self, phase: str, waited: float) -> None:
        sys.stderr.write(
            f"yatrain: error (rank {self.rank}): {phase} has made no progress for "
            f"{waited:.0f} s (train.collective_timeout_s {self.timeout_s:g}): a collective is "
            "stuck because another rank hung or died (its output says which); stopping this "
            "rank, continue with --resume auto\n"
        )
        sys.stderr.flush()
        os._exit(EXIT_CODE)  # the main thread is blocked in the collective: end it here
