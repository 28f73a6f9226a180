"""Where a step's time goes: compute, exposed communication, data wait, optimizer, the rest.

``train_step`` moves a ``StepClock`` through the phases of a step, each an interval timed
directly (``sharding.timing.IntervalClock``: perf_counter on CPU, CUDA events on GPU read
only after the synchronisation logging already makes):

- ``model``: forward and backward over the micro-batches, the last reductions and the
  gradient clipping (with its norm's all-reduce). The engine's own clock times, inside it,
  every wait on a gather or a reduction: that is exposed communication, the rest compute.
- ``guard``: the guard's agreement on stopping and finiteness (one tiny all-reduce): exposed
  communication too.
- ``optimizer``: the optimizer's step, the check that the new weights are finite,
  ``after_step``; less Muon's exchange, which times itself (``optim.exchange_timing``): its
  waits on the all-to-alls are exposed communication, its Newton-Schulz compute.

The meter adds the data wait (the loader, on the host), the logging all-reduce, and calls
what no timer covers unattributed (setting the learning rate, the loop's bookkeeping).
Busy time, compared across ranks to find stragglers, is the step minus its waits on
collectives and data: in lockstep every rank's step time is the same, its busy time is not.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from yatrain.optim.exchange_timing import exchange_times
from yatrain.sharding import ShardedEngine
from yatrain.sharding.timing import IntervalClock

PHASES = ("model", "guard", "optimizer")


@dataclass(frozen=True)
class Breakdown:
    """Seconds per step of one logging window, by part (see the module docstring)."""

    compute_s: float
    comm_exposed_s: float
    data_wait_s: float
    optimizer_s: float
    unattributed_s: float

    @classmethod
    def of(cls, timed: tuple[float, float, float], data_s: float, window_s: float, steps: int):
        """Per step, from a window's ``StepClock.take()`` (plus waits outside the steps
        already added to its communication), its data wait and its length."""
        compute, comm, optimizer = timed
        rest = window_s - compute - comm - data_s - optimizer
        return cls(compute / steps, comm / steps, data_s / steps, optimizer / steps, rest / steps)

    def to_fields(self) -> dict[str, float]:
        return dataclasses.asdict(self)


class StepClock:
    """The timers of a logging window's steps; ``phase`` moves from one part to the next."""

    def __init__(self, engine: ShardedEngine, device: torch.device) -> None:
        self.waits = engine.waits
        self.exchange = exchange_times(engine.waits)  # Muon's, if any: optim.exchange_timing
        self.clocks = {name: IntervalClock(device) for name in PHASES}
        self.current: IntervalClock | None = None
        self.name: str | None = None  # the part running now (a hang report says it)
        self.mark = None

    def phase(self, name: str | None) -> None:
        """Close the current part and open ``name`` (None: the step is over)."""
        if self.current is not None:
            self.current.stop(self.mark)
        self.name = name
        self.current = self.clocks[name] if name is not None else None
        self.mark = self.current.start() if self.current is not None else None
        self.waits.active = name == "model"
        self.exchange.active = name == "optimizer"

    @property
    def intervals(self) -> int:
        """Intervals timed so far (the overhead benchmark counts them)."""
        clocks = [self.waits, *self.clocks.values()]
        return self.exchange.intervals + sum(c.intervals for c in clocks)

    def take(self) -> tuple[float, float, float]:
        """(compute, exposed communication, optimizer) seconds timed since the last take
        (after a synchronisation); resets the timers."""
        waits, (ns, exchange) = self.waits.take(), self.exchange.take()
        model, guard, optimizer = (self.clocks[name].take() for name in PHASES)
        return model - waits + ns, waits + guard + exchange, optimizer - ns - exchange


class NoClock:
    """``train_step`` without a clock (benchmarks' baselines, tests)."""

    def phase(self, name: str | None) -> None:
        pass
