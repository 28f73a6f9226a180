"""The recipe against the job it runs in: the world size must divide the global batch into
micro-batches, and the shard group (``sharding.shard_group_size``) must divide the world.
Known only at launch, so checked by ``train.setup`` (and the planner) rather than at load.
"""

from __future__ import annotations

from yatrain.config import Recipe
from yatrain.errors import ConfigError


def validate_world_size(recipe: Recipe, world_size: int) -> None:
    """Check the global batch splits evenly into micro-batches across world_size ranks."""
    data = recipe.data
    per_step = data.micro_batch_size * world_size
    if data.global_batch_size % per_step == 0:
        return
    lower = data.global_batch_size // per_step * per_step
    valid = [lower, lower + per_step] if lower else [per_step, 2 * per_step]
    raise ConfigError(
        f"'data.global_batch_size' ({data.global_batch_size}) is not divisible by "
        f"data.micro_batch_size ({data.micro_batch_size}) x world size ({world_size}) = "
        f"{per_step}; set it to a multiple of {per_step} such as "
        f"{' or '.join(map(str, valid))}, or change data.micro_batch_size"
    )


def shard_group_size(recipe: Recipe, world_size: int, local_world_size: int) -> int:
    """How many ranks shard each layer: the recipe's number, the node's ranks for "auto"
    (torchrun's local world size), the whole world when unset. One line if it does not
    divide the world."""
    wanted = recipe.sharding.shard_group_size
    size = {None: world_size, "auto": local_world_size}.get(wanted, wanted)
    if world_size % size == 0:
        return size
    sizes = ", ".join(str(k) for k in range(1, world_size + 1) if world_size % k == 0)
    named = f"{wanted} (auto: {size} ranks per node)" if wanted == "auto" else str(wanted)
    raise ConfigError(
        f"'sharding.shard_group_size' {named} does not divide the world size ({world_size}); "
        f"set it to one of {sizes} (usually the GPUs per node), or remove it to shard over "
        "all ranks"
    )
