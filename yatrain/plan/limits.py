"""How much device memory to plan against, and what ``activation_checkpoint_layers: auto``
becomes on this device. ``yatrain plan``, the sweep and the training loop all ask here."""

from __future__ import annotations

import torch

from yatrain.common import GIB
from yatrain.plan.memory import MemoryPlan
from yatrain.plan.report import explain
from yatrain.plan.search import plan_memory
from yatrain.recipe.config import Recipe
from yatrain.sharding.sizes import device_memory

ASSUMED_GPU_GIB = 80.0  # A100/H100 80GB class: what `yatrain plan` assumes without a GPU


def memory_limit(
    recipe: Recipe,
    device: torch.device | str,
    gpu_memory_gib: float | None = None,
    assumed_gib: float | None = None,
) -> tuple[int | None, str]:
    """Bytes per device to plan against, and where the figure comes from, first found of:
    ``gpu_memory_gib`` (the ``--gpu-memory`` flag), ``sharding.gpu_memory_gib``, the CUDA
    device's total memory, ``assumed_gib``. None when nothing gives a limit (a CPU)."""
    device = torch.device(device)
    if gpu_memory_gib is not None:
        return int(gpu_memory_gib * GIB), "--gpu-memory"
    if recipe.sharding.gpu_memory_gib is not None:
        return int(recipe.sharding.gpu_memory_gib * GIB), "sharding.gpu_memory_gib"
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory, torch.cuda.get_device_name(
            device
        )
    if assumed_gib is not None:
        return int(assumed_gib * GIB), "assumed: no GPU here, pass --gpu-memory"
    return None, f"{device.type} has no device memory limit"


def staging_memory(recipe: Recipe, device: torch.device | str) -> int | None:
    """The memory ``sharding.reduce_staging_mib: auto`` is a share of on ``device``: the
    memory planned against (``memory_limit``), else the machine's (a CPU's RAM). The engine
    and the fit check both ask here, so they size the same staging buffer."""
    return memory_limit(recipe, device)[0] or device_memory(torch.device(device))


def local_device() -> torch.device:
    """The device a plan is for when none is given: the first GPU, else the CPU."""
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def resolve_auto_checkpoint_layers(
    recipe: Recipe, world_size: int, device: torch.device | str
) -> tuple[int, str]:
    """The layer count ``activation_checkpoint_layers: auto`` stands for on this device, and
    the line that logs it. A device without a memory limit (a CPU, unless
    ``sharding.gpu_memory_gib`` is set) gets 0: nothing to plan against. (A training run
    asks ``fit.start_plan``, which plans once for this and its fit check.)"""
    layers, line, _ = plan_auto(recipe, world_size, *memory_limit(recipe, device))
    return layers, line


def plan_auto(
    recipe: Recipe,
    world_size: int,
    limit: int | None,
    source: str,
    shard_group: int | None = None,
) -> tuple[int, str, MemoryPlan | None]:
    """What ``auto`` becomes against ``limit`` bytes (from ``source``), the line that says
    why, and the whole plan it came from (None without a limit: 0 layers, no plan)."""
    prefix = "sharding.activation_checkpoint_layers auto"
    if limit is None:
        fix = "set sharding.gpu_memory_gib to plan for one"
        return 0, f"{prefix} -> 0: {source} to plan against ({fix})", None
    plan = plan_memory(recipe, world_size, limit, shard_group=shard_group)
    layers = plan.activation_checkpoint_layers
    return layers, f"{prefix} -> {layers} ({source}): {explain(plan)}", plan
