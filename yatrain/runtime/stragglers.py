"""Which rank is slow: busy times compared across ranks at every log, on no extra collective.

In lockstep data parallelism every rank's step takes as long as the slowest one's; what
differs is the busy time (the step minus its waits on collectives and data, ``timing``).
At each log every rank puts its busy time into its own slot of the vector the loss is
all-reduced in anyway, so all ranks learn every rank's busy time. The record carries the
slowest rank, its busy time and the median; the console names the rank when it has been
the slowest by at least ``STRAGGLER_RATIO`` x the median for ``STRAGGLER_LOGS`` logs in a
row (one slow log is noise: a page fault, a neighbour's burst).
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from yatrain.runtime.host_reads import device_values, host_read
from yatrain.runtime.process import Runtime

STRAGGLER_RATIO = 1.2  # slowest busy time / median busy time that counts as lagging
STRAGGLER_LOGS = 3  # consecutive logged windows a rank must lag before the console says so


def reduce_loss_and_busy(
    loss: torch.Tensor, busy_s: float, runtime: Runtime
) -> tuple[float | None, list[float]]:
    """(the loss averaged over ranks, every rank's busy time): one all-reduce, the one the
    loss needed anyway. (None, []) where the values are unknown (a dry run)."""
    if not runtime.distributed:
        return device_values(loss)[0], [busy_s]
    values = torch.zeros(1 + runtime.world_size, device=loss.device, dtype=torch.float64)
    values[0] = loss.detach().to(torch.float64)
    values[1 + runtime.rank] = busy_s
    dist.all_reduce(values)
    numbers = host_read(values.tolist)
    if numbers is None:  # unknown: a dry run's fake values, and its peers' times
        return None, []
    return numbers[0] / runtime.world_size, numbers[1:]


def straggler_fields(busy: list[float]) -> dict:
    """The record's fields: the slowest rank, its busy time and the median (None where the
    times are unknown: a dry run)."""
    if not busy:
        return {"slowest_rank": None, "slowest_busy_s": None, "median_busy_s": None}
    slowest = max(range(len(busy)), key=busy.__getitem__)
    return {
        "slowest_rank": slowest,
        "slowest_busy_s": busy[slowest],
        "median_busy_s": statistics.median(busy),
    }


class StragglerWatch:
    """Counts how many logs in a row the same rank has lagged (see the module docstring)."""

    def __init__(self) -> None:
        self.rank: int | None = None
        self.count = 0

    def note(
        self, slowest_rank: int | None, slowest_busy_s: float | None, median_busy_s: float | None
    ) -> str | None:
        """The console line once a rank has lagged ``STRAGGLER_LOGS`` logs in a row (and at
        every log while it goes on), else None (also where the times are unknown)."""
        if slowest_rank is None or slowest_busy_s is None or median_busy_s is None:
            return None
        ratio = slowest_busy_s / median_busy_s if median_busy_s > 0 else 0.0
        if ratio < STRAGGLER_RATIO:
            self.rank, self.count = None, 0
            return None
        self.count = self.count + 1 if slowest_rank == self.rank else 1
        self.rank = slowest_rank
        if self.count < STRAGGLER_LOGS:
            return None
        return (
            f"straggler: rank {slowest_rank} is {ratio:.1f}x slower than the median "
            f"({slowest_busy_s:.3f}s vs {median_busy_s:.3f}s busy per step, "
            f"{self.count} logs in a row); the other ranks wait for it in collectives"
        )
