"""The fit check before launch: will a step's predicted peak fit the memory this device has?

``pretrain`` asks here before it allocates anything, so a recipe too big for the machine is
refused in a second with one line (the planner's peak, what is available, what would fit)
instead of failing in the allocator minutes later, or being killed by the kernel. On CUDA the
planner's per-GPU peak (tensors plus its runtime allowance) is compared with the GPU's memory
(or ``sharding.gpu_memory_gib``); on a CPU the tensor peak is compared with the RAM the
kernel says is available (``MemAvailable``, and the cgroup's limit where one is set), shared
among this machine's ranks.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from yatrain.common import format_bytes
from yatrain.errors import ConfigError
from yatrain.plan.limits import memory_limit, staging_memory
from yatrain.plan.memory import plan_for_layers, plan_memory
from yatrain.recipe.config import Recipe


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


def check_fit(recipe: Recipe, world_size: int, device: torch.device, layers: int) -> None:
    """Raise ConfigError when the run's predicted per-device peak exceeds what the device
    has (see the module docstring); ``layers`` is the resolved checkpointed-layer count."""
    if device.type == "cuda":
        have, source = memory_limit(recipe, device)
        allowance = None  # the planner's: CUDA context, NCCL, fragmentation
    else:
        ram = available_ram()
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        have = None if ram is None else ram // max(local, 1)
        source = "available RAM" + (f" / {local} local ranks" if local > 1 else "")
        allowance = 0  # tensors only: the process itself is not planned
    if have is None:
        return
    staging = staging_memory(recipe, device)
    plan = plan_for_layers(recipe, world_size, layers, have, allowance, staging)
    if plan.fits:
        return
    raise ConfigError(
        f"this run does not fit: the planner predicts a peak of "
        f"{format_bytes(plan.peak_bytes_per_gpu, 'GiB')} per device ({layers} of "
        f"{recipe.model.n_layers} layers checkpointed, {world_size} device(s)) and "
        f"{format_bytes(have, 'GiB')} is available ({source}): "
        f"{fit_advice(recipe, world_size, have, allowance)}; `yatrain plan` shows the breakdown, "
        "--no-fit-check skips this check"
    )


def fit_advice(recipe: Recipe, world_size: int, have: int, allowance: int | None) -> str:
    """What would make it fit, by the planner: more checkpointed layers, the document
    mask's longest sequence, context parallelism, more devices, or a smaller micro-batch."""
    best = plan_memory(recipe, world_size, have, allowance)
    if best.fits:
        return (
            f"set sharding.activation_checkpoint_layers={best.activation_checkpoint_layers} "
            "(or auto)"
        )
    smallest, context = best.min_context_parallel, ""
    if smallest is not None:
        context = (
            f"set sharding.context_parallel={smallest['context_parallel']} and "
            f"sharding.activation_checkpoint_layers={smallest['activation_checkpoint_layers']}"
        )
    masked = document_mask_words(recipe, world_size, have, allowance)
    if masked:
        return f"{masked}{', or ' + context if context else ''}"
    if context:
        return context
    if best.min_gpus is not None and best.shard_group_size < world_size:
        return f"use sharding.shard_group_size of at least {best.min_gpus} (or unset it)"
    if best.min_gpus is not None:
        per_step = best.batch_for_min_gpus()
        batch = f" and data.global_batch_size a multiple of {per_step}" if per_step else ""
        return f"use at least {best.min_gpus} devices with all layers checkpointed{batch}"
    return "lower data.micro_batch_size or data.seq_len (no device count helps)"


def longest_masked_window(
    recipe: Recipe, world_size: int, have: int, allowance: int | None
) -> int | None:
    """The longest ``data.seq_len`` (a multiple of 2 x CP x 64) at which this recipe with
    its dense document mask fits (all layers may be checkpointed); None if none does."""
    step = 2 * recipe.sharding.context_parallel * 64

    def fits(seq: int) -> bool:
        data = dataclasses.replace(recipe.data, seq_len=seq)
        plan = plan_for_layers(
            dataclasses.replace(recipe, data=data),
            world_size,
            recipe.model.n_layers,
            have,
            allowance,
        )
        return bool(plan.fits)

    if fits(recipe.data.seq_len):
        return recipe.data.seq_len
    low, high = 0, recipe.data.seq_len // step  # in steps: fits(low * step), not high's
    while low + 1 < high:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid * step) else (low, mid)
    return low * step if low else None


def document_mask_words(
    recipe: Recipe, world_size: int, have: int, allowance: int | None
) -> str | None:
    """When only the dense document mask keeps the run from fitting: its size, and the
    longest window at which it fits (``data.document_mask``)."""
    if not recipe.data.document_mask:
        return None
    data = dataclasses.replace(recipe.data, document_mask=False)
    if not plan_memory(dataclasses.replace(recipe, data=data), world_size, have, allowance).fits:
        return None
    mask = plan_for_layers(recipe, world_size, 0).breakdown.get("attention_masks", 0)
    longest = longest_masked_window(recipe, world_size, have, allowance)
    within = f"at most {longest} tokens" if longest else "no window"
    return (
        f"data.document_mask builds a dense mask of {format_bytes(mask, 'GiB')} per "
        f"micro-batch at {recipe.data.seq_len} tokens and fits {within} here; set "
        f"data.document_mask: false or data.seq_len to at most that"
    )
