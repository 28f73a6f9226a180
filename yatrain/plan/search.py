"""The smallest setting that fits: how many layers to checkpoint on these GPUs and, when even
all of them do not, how many GPUs or which context-parallel size would.

A search over ``memory.plan_for_layers`` (the arithmetic for one setting): the peak only
falls as more layers are checkpointed or the state is sharded over more ranks, so each
answer is the first setting that fits.
"""

from __future__ import annotations

import dataclasses

from yatrain.plan.layout import planned_group
from yatrain.plan.memory import MemoryPlan, plan_for_layers
from yatrain.plan.traffic import traffic_table
from yatrain.recipe.config import Recipe
from yatrain.recipe.topology import divisors


def min_gpus_to_fit(
    recipe: Recipe, world_size: int, gpu_memory_bytes: int, runtime_allowance_bytes: int | None
) -> int | None:
    """Smallest GPU count >= world_size at which all layers checkpointed fit; None if the
    unsharded part (buffers, activations, allowance) alone is too big for any count. Under
    hybrid sharding more replicas do not help: this is the shard group it would take. Under
    context parallelism a multiple of its size. Sharding over the whole world, a count whose
    data ranks take the global batch (``topology.validate_world_size``) where one fits it."""
    n = recipe.model.n_layers
    whole_world = recipe.sharding.shard_group_size is None
    sharding = dataclasses.replace(recipe.sharding, shard_group_size=None)
    recipe = dataclasses.replace(recipe, sharding=sharding)

    cp = recipe.sharding.context_parallel  # counts are whole CP groups

    def fits(groups: int) -> bool:
        args = (gpu_memory_bytes, runtime_allowance_bytes)
        return bool(plan_for_layers(recipe, groups * cp, n, *args).fits)

    first = max(world_size // cp, 1)
    high = first
    while not fits(high):
        if high >= 2**24:
            return None
        high *= 2
    low = max(first, high // 2)
    while low < high:  # sharded bytes only shrink as the count grows
        mid = (low + high) // 2
        low, high = (low, mid) if fits(mid) else (mid + 1, high)
    slots = recipe.data.global_batch_size // recipe.data.micro_batch_size
    takes_batch = [g for g in divisors(slots) if g >= high] if whole_world else []
    return (takes_batch[0] if takes_batch else high) * cp


def context_parallel_sizes(recipe: Recipe, group: int) -> list[int]:
    """CP sizes above the recipe's a shard group of ``group`` ranks can take: they divide
    the group, and 2 x CP divides the sequence (``sharding.context_parallel``'s rules)."""
    seq, own = recipe.data.seq_len, recipe.sharding.context_parallel
    return [c for c in divisors(group) if c > own and seq % (2 * c) == 0]


def min_context_parallel(
    recipe: Recipe,
    world_size: int,
    gpu_memory_bytes: int,
    runtime_allowance_bytes: int | None,
    shard_group: int | None = None,
) -> dict | None:
    """The smallest CP size on these GPUs at which the recipe fits, and the fewest
    checkpointed layers it then needs; None when none does."""
    group = planned_group(recipe, world_size, shard_group)
    for cp in context_parallel_sizes(recipe, group):
        sharding = dataclasses.replace(recipe.sharding, context_parallel=cp)
        candidate = dataclasses.replace(recipe, sharding=sharding)
        for k in range(recipe.model.n_layers + 1):
            args = (gpu_memory_bytes, runtime_allowance_bytes)
            if plan_for_layers(candidate, world_size, k, *args, shard_group=group).fits:
                return {"context_parallel": cp, "activation_checkpoint_layers": k}
    return None


def plan_memory(
    recipe: Recipe,
    world_size: int,
    gpu_memory_bytes: int | None,
    runtime_allowance_bytes: int | None = None,
    device_memory_bytes: int | None = None,
    *,
    shard_group: int | None = None,
) -> MemoryPlan:
    """The smallest number of checkpointed first layers that fits ``gpu_memory_bytes``
    (the other arguments as ``plan_for_layers``'s).

    Without a memory limit the recipe's own setting is reported (0 for ``auto``). When even
    all layers checkpointed do not fit, the plan has ``fits=False``, all layers, and
    ``min_gpus``. ``recipe_setting`` holds the plan for the recipe's own number; for
    ``auto``, the number it resolves to here (``resolved_layers``): this plan's.
    """
    n = recipe.model.n_layers
    setting = recipe.sharding.activation_checkpoint_layers
    own = 0 if setting == "auto" else int(setting)
    args = (gpu_memory_bytes, runtime_allowance_bytes, device_memory_bytes)

    def layers(k: int) -> MemoryPlan:
        return plan_for_layers(recipe, world_size, k, *args, shard_group=shard_group)

    recipe_plan = layers(own)
    if gpu_memory_bytes is None:
        plan = recipe_plan
    else:
        plan = next((p for k in range(n + 1) if (p := layers(k)).fits), None)
        if plan is None:
            plan = layers(n)
            limits = (gpu_memory_bytes, runtime_allowance_bytes)
            plan.min_gpus = min_gpus_to_fit(recipe, plan.shard_group_size, *limits)
            plan.min_context_parallel = min_context_parallel(
                recipe, world_size, *limits, plan.shard_group_size
            )
    k = plan.activation_checkpoint_layers
    plan.traffic = traffic_table(recipe, world_size, plan.shard_group_size, k)
    if setting == "auto":  # what start-up resolves it to (plan/limits.py): this plan
        recipe_plan = plan
    plan.recipe_setting = {
        "activation_checkpoint_layers": setting,
        "resolved_layers": recipe_plan.activation_checkpoint_layers,
        "peak_bytes_per_gpu": recipe_plan.peak_bytes_per_gpu,
        "fits": recipe_plan.fits,
    }
    return plan
