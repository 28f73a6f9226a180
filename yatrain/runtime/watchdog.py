"""Hangs end: a distributed run stuck in one step or save for too long stops with one line.

A rank that hangs (a deadlocked kernel, a stopped process) leaves its peers waiting in a
collective forever, and NCCL's own timeout aborts the process without a word on where it
was. The loop tells the watchdog what it is doing (``phase("step 12")``); a daemon thread
checks every few seconds and, when one phase has lasted ``train.collective_timeout_s``,
prints one line naming the step and this rank and ends the process (the run directory's
lock goes with it; ``--resume auto`` continues from the last checkpoint). The process
group's own timeout is set a minute later, as a backstop.

Once ``attach``-ed to a run (``hang.py``), it also keeps the rank's stack file armed for the
same timeout, answers other ranks' requests for a hang report, and before it stops the
process takes part in that report, which names the rank that hung or died.
"""

from __future__ import annotations

import os
import sys
import threading
import time

from yatrain.runtime.hang import HangReporter, StackFile
from yatrain.runtime.launcher_link import tell_launcher

EXIT_CODE = 3  # a stuck collective (2: a user error, 130: stopped by a signal)


class Watchdog:
    """See the module docstring; inactive (no thread) in a single process."""

    def __init__(self, timeout_s: float, rank: int, active: bool) -> None:
        self.timeout_s, self.rank = timeout_s, rank
        self.interval = min(5.0, max(timeout_s / 5, 0.1))  # between checks
        self._phase: str | None = None
        self._since = time.monotonic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        self.reporter: HangReporter | None = None
        self.stacks: StackFile | None = None
        self.active = active
        self._standing_down = False
        self.stopping = threading.Event()  # set once this thread ends the process
        if active:
            self._thread = threading.Thread(
                target=self._watch, name="yatrain-watchdog", daemon=True
            )
            self._thread.start()

    @property
    def current(self) -> str | None:
        return self._phase

    def attach(self, reporter: HangReporter | None, stacks: StackFile | None) -> None:
        """Report through ``reporter`` and keep ``stacks`` armed (both only when active)."""
        if self.active:
            self.reporter, self.stacks = reporter, stacks

    def phase(self, what: str | None) -> None:
        """What the run is doing from now on (None: nothing to watch)."""
        with self._lock:
            self._phase, self._since = what, time.monotonic()
        if self.stacks is not None and not self._standing_down:
            self.stacks.arm(self.timeout_s if what is not None else None)

    def stand_down(self) -> None:
        """Stop watching but keep the phase (a rank that reports a lost peer is not stuck,
        and its note still says where it was)."""
        self._standing_down = True
        if self.stacks is not None:
            self.stacks.arm(None)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.stacks is not None:
            self.stacks.close()
            self.stacks = None

    def _watch(self) -> None:
        while not self._stop.wait(self.interval):
            with self._lock:
                phase, waited = self._phase, time.monotonic() - self._since
            if phase is not None and waited >= self.timeout_s and not self._standing_down:
                self._stop_process(phase, waited)
            reporter = self.reporter
            if reporter is not None and not reporter.published and reporter.requested():
                reporter.publish("asked for by another rank")

    def wait_for_exit(self, seconds: float = 60.0) -> None:
        """Block a thread that would print a second error line while this one ends the
        process (the collective it was stuck in failing once a peer is gone)."""
        time.sleep(seconds)

    def _stop_process(self, phase: str, waited: float) -> None:
        self.stopping.set()
        which = "its output says which"
        if self.reporter is not None:
            headline = self.reporter.report(f"{phase} made no progress for {waited:.0f} s")
            report = self.reporter.report_path
            which = f"the hang report, {report}, says: {headline}" if headline else which
        line = (
            f"{phase} has made no progress for {waited:.0f} s (train.collective_timeout_s "
            f"{self.timeout_s:g}): a collective is stuck because another rank hung or died "
            f"({which}); stopping this rank, continue with --resume auto"
        )
        sys.stderr.write(f"yatrain: error (rank {self.rank}): {line}\n")
        sys.stderr.flush()
        tell_launcher(line, EXIT_CODE, follows_another=True)  # the launcher's summary says it
        if self.reporter is not None:
            self.reporter.stopped()
        os._exit(EXIT_CODE)  # the main thread is blocked in the collective: end it here
