"""The memory a run plans against, resolved once at its start: how much, where the figure
comes from, what the planner adds for the runtime, and what ``auto`` staging is a share of.

On CUDA it is the GPU's memory (or ``sharding.gpu_memory_gib``) and the planner's runtime
allowance. A CPU has no device memory to plan ``auto`` against, so ``auto`` there resolves
to 0 layers (unless ``sharding.gpu_memory_gib`` is set), while the fit check compares the
tensor peak with the RAM the kernel says is available (``MemAvailable``, and the cgroup's
limit where one is set), shared among this machine's ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from yatrain.plan.limits import memory_limit, staging_memory
from yatrain.recipe.config import Recipe
from yatrain.recipe.topology import JobLayout


@dataclass(frozen=True)
class MemoryBudget:
    limit: int | None  # bytes per device ``auto`` plans against; None: nothing to plan against
    source: str  # where ``limit`` comes from
    have: int | None  # bytes the fit check compares the peak with; None: no check
    have_source: str  # where ``have`` comes from
    allowance: int | None  # the runtime's share the fit adds: None = the planner's; 0 = none
    staging: int | None  # what ``sharding.reduce_staging_mib: auto`` is a share of
    shares_ram: bool = False  # ``have`` is a machine's RAM shared by its ranks (a CPU)

    @property
    def fit_is_auto_plan(self) -> bool:
        """The fit check asks what ``auto`` planned against (a GPU): one plan answers both."""
        return self.have == self.limit and self.allowance is None


def memory_budget(recipe: Recipe, device: torch.device, layout: JobLayout) -> MemoryBudget:
    """This run's budget (see the module docstring)."""
    limit, source = memory_limit(recipe, device)
    staging = staging_memory(recipe, device)
    if device.type == "cuda":
        return MemoryBudget(limit, source, limit, source, None, staging)
    ram, local = available_ram(), layout.local_world_size
    have = None if ram is None else ram // max(local, 1)
    have_source = "available RAM" + (f" / {local} local ranks" if local > 1 else "")
    return MemoryBudget(limit, source, have, have_source, 0, staging, shares_ram=True)


def available_ram() -> int | None:
    """Bytes of RAM a new allocation can get now: ``MemAvailable``, capped by a cgroup v2
    limit; None where neither can be read."""
    found = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError):
        pass
    cgroup = Path("/sys/fs/cgroup")
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            found.append(int(limit) - int((cgroup / "memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return min(found) if found else None
