"""The hardware each shipped recipe names in its header, and the planner's answer there.

A pretraining recipe is written for a cluster: its header says which, in one line the tests
read (``# Hardware: 256 x 80 GB GPUs``, or ``# Hardware: 1 CPU process with 4 GiB of RAM``).
The README's recipe table and the recipe tests both come from here, so neither can drift
from the recipes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from conftest import ROOT

from yatrain.common import GIB
from yatrain.plan import MemoryPlan, plan_memory
from yatrain.recipe.config import Recipe

RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
GPUS = re.compile(r"^# Hardware: (\d+) x (\d+) GB GPUs\b", re.M)
CPU = re.compile(r"^# Hardware: 1 CPU process with (\d+) GiB of RAM\b", re.M)
# What a card sold as N GB reports to the engine (torch.cuda's total_memory), in GiB: an
# H100 80GB reports about 79.2 GiB, so `--gpu-memory 80` would overstate it.
REPORTED_GIB = {80: 79.0}


@dataclass(frozen=True)
class Hardware:
    devices: int
    memory_gib: float
    words: str  # as the README's table shows it
    allowance_bytes: int | None  # None: the planner's GPU allowance; 0 on a CPU (tensors only)


def stated_hardware(path: Path) -> Hardware | None:
    """The hardware line of a recipe's header, None when it has none."""
    text = path.read_text()
    if match := GPUS.search(text):
        gpus, card = int(match.group(1)), int(match.group(2))
        return Hardware(gpus, REPORTED_GIB[card], f"{gpus} x {card} GB GPUs", None)
    if match := CPU.search(text):
        ram = int(match.group(1))
        return Hardware(1, float(ram), f"1 CPU, {ram} GiB RAM", 0)
    return None


def plan_there(recipe: Recipe, hardware: Hardware) -> MemoryPlan:
    """The planner at the stated hardware, as ``yatrain plan`` answers (no model built)."""
    limit = int(hardware.memory_gib * GIB)
    return plan_memory(recipe, hardware.devices, limit, hardware.allowance_bytes)
