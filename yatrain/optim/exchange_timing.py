"""Muon's exchange in the step-time breakdown: its waits on the all-to-alls are exposed
communication, its Newton-Schulz compute, not "optimizer".

The exchange runs in the step's optimizer phase, where the engine's waits clock (the one its
communicators time ``wait`` with) is off. So it times both itself, on two clocks kept beside
that waits clock (``exchange_times``: one pair per engine, made on first use), where the
step clock (``train/timing.py``) finds them from the engine alone: it turns them on for the
optimizer phase and moves their seconds out of it at each logging window. Off, they time
nothing (an exchange built for a benchmark or a test costs no events).
"""

from __future__ import annotations

import weakref

import torch

from yatrain.sharding.timing import IntervalClock


class ExchangeTimes:
    """The exchange's waits and its Newton-Schulz, each an ``IntervalClock``, both off until
    ``active`` is set."""

    def __init__(self, cuda: bool) -> None:
        device = torch.device("cuda" if cuda else "cpu")
        self.waits, self.compute = IntervalClock(device), IntervalClock(device)
        self.active = False

    @property
    def active(self) -> bool:
        return self.waits.active

    @active.setter
    def active(self, on: bool) -> None:
        self.waits.active = self.compute.active = on

    @property
    def intervals(self) -> int:
        """Intervals timed so far (the overhead benchmark counts them)."""
        return self.waits.intervals + self.compute.intervals

    def take(self) -> tuple[float, float]:
        """(Newton-Schulz, waits) seconds since the last take (CUDA: after a sync)."""
        return self.compute.take(), self.waits.take()


_BESIDE: weakref.WeakKeyDictionary[IntervalClock, ExchangeTimes] = weakref.WeakKeyDictionary()


def exchange_times(waits: IntervalClock | None) -> ExchangeTimes:
    """The exchange's clocks beside ``waits``, an engine's waits clock (the same pair for
    the exchange and the step clock); None (a communicator no engine times): a pair of its
    own that nobody turns on."""
    if waits is None:
        return ExchangeTimes(cuda=False)
    if waits not in _BESIDE:
        _BESIDE[waits] = ExchangeTimes(waits.cuda)
    return _BESIDE[waits]
