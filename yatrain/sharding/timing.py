"""Intervals timed on the training thread without adding a device synchronisation.

``IntervalClock`` sums intervals: on CPU with ``time.perf_counter``; on CUDA with a pair of
timing events recorded on the current stream, whose elapsed times are read only by
``take()``, which the caller makes after a synchronisation it does anyway (the logging's).
The engine's ``waits`` clock times the exposed communication: how long the training thread
(CPU) or the compute stream (CUDA: between events recorded around ``wait_event``) waited on
a gather or a reduction. It also says what it is waiting on right now (``blocked``), which a
hang report reads from another thread.
"""

from __future__ import annotations

import time
from typing import TypeAlias

import torch

# Where an interval started: a CUDA timing event, a perf_counter reading, or None (inactive).
Mark: TypeAlias = "torch.cuda.Event | float | None"


class IntervalClock:
    """Sums timed intervals until ``take()`` (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.seconds = 0.0
        self.pairs: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # CUDA, not read yet
        self.intervals = 0  # timed so far (overhead accounting)
        self.active = True  # the engine's waits: only inside ``train_step`` (not evaluation)
        self.blocked: str | None = None  # what the current interval waits on (CPU)
        self.blocked_since = 0.0

    def start(self, what: str | None = None) -> Mark:
        """Open an interval waiting on ``what``; returns the mark ``stop`` takes (None while
        inactive: then only ``blocked`` is kept)."""
        self.blocked, self.blocked_since = what, time.monotonic()
        if not self.active:
            return None
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def stop(self, mark: Mark) -> None:
        self.blocked = None
        if mark is None:
            return
        self.intervals += 1
        if isinstance(mark, float):  # CPU
            self.seconds += time.perf_counter() - mark
        else:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.pairs.append((mark, end))

    def take(self) -> float:
        """Seconds timed since the last ``take`` (CUDA: call after a synchronisation)."""
        seconds = self.seconds + sum(a.elapsed_time(b) for a, b in self.pairs) / 1e3
        self.seconds, self.pairs = 0.0, []
        return seconds
