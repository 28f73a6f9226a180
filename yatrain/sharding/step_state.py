"""The engine's per-step state: where a step is and what it has accumulated so far.

One ``StepState`` lives as long as its engine; ``after_step`` resets it. The unit hooks
(``hooks.py``) move it through a step's micro-batches, the gradient routing (``arrival.py``)
counts each unit's arriving gradients and remembers its latest reduction, and the end of the
step (``gradients.py``) reads those reductions and hands the averaging factor from
``reduce_gradients`` to ``clip_grad_norm_``. A hang report reads ``phase``, ``unit`` and
``micro_batches`` from another thread (``ShardedEngine.progress``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from yatrain.sharding.reduce import ReduceJob
from yatrain.sharding.timing import IntervalClock

Phase = Literal["idle", "forward", "backward"]
UnitPhase = Literal["idle", "forward", "backward", "done"]


@dataclass
class StepState:
    """Everything an optimizer step accumulates, for ``n_units`` units."""

    n_units: int
    phase: Phase = "idle"
    unit: int | None = None  # the unit whose forward or backward runs (progress)
    # Per unit: idle | forward | backward | done, in the current micro-batch.
    unit_phase: list[UnitPhase] = field(init=False)
    # Per unit: the weights bound for its forward that expect a gradient (empty without).
    leaves: list[list[torch.Tensor]] = field(init=False)
    waiting_grads: list[int] = field(init=False)  # gradients its backward has yet to deliver
    has_grad: list[bool] = field(init=False)  # its shard was reduced into at least once
    last_job: list[ReduceJob | None] = field(init=False)  # its shard's latest reduction
    micro_batches: int = 0  # forwards with a backward to come, this step
    expected_micro_batches: int | None = None  # told by ``expect_micro_batches``
    small_ready: bool = False  # the norm group is gathered and bound
    # 1 / (ranks x micro-batches): set by ``reduce_gradients``, applied by ``clip_grad_norm_``.
    grad_scale: float | None = None

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """A fresh step: nothing gathered for it, nothing reduced, no micro-batch yet."""
        n = self.n_units
        self.phase = "idle"
        self.unit = None
        self.unit_phase = ["idle"] * n
        self.leaves = [[] for _ in range(n)]
        self.waiting_grads = [0] * n
        self.has_grad = [False] * n
        self.last_job = [None] * n
        self.micro_batches = 0
        self.expected_micro_batches = None
        self.small_ready = False
        self.grad_scale = None

    def begin_micro_batch(self, with_backward: bool) -> None:
        """The first unit's forward starts a micro-batch (counted when a backward follows)."""
        self.phase = "forward"
        self.unit_phase = ["idle"] * self.n_units
        if with_backward:
            self.micro_batches += 1

    @property
    def in_last_micro_batch(self) -> bool:
        """The step's last micro-batch, as announced by ``expect_micro_batches``."""
        return self.micro_batches == self.expected_micro_batches

    def progress(self, phase: Phase, waits: IntervalClock, entered: int) -> dict[str, Any]:
        """Where this rank is in its step (read by a hang report, from another thread):
        ``phase``, unit, micro-batch, the ``entered`` collectives and what ``waits`` is
        blocked on, for how long."""
        blocked = waits.blocked
        return {
            "phase": phase,
            "unit": self.unit,
            "micro_batch": self.micro_batches,
            "collectives": entered,
            "waiting_on": blocked,
            "waiting_s": time.monotonic() - waits.blocked_since if blocked else None,
        }
