"""The recipe against the job it runs in: the world size must divide the global batch into
micro-batches, and the shard group (``sharding.shard_group_size``) must divide the world.
Known only at launch, so checked by ``train.setup`` (and the planner) rather than at load.

Under context parallelism (``sharding.context_parallel`` = CP) the world is data x context:
CP consecutive ranks share each window, so the batch is split over world / CP data ranks,
and CP divides the shard group (a CP group never spans two shard groups, or two nodes).

A run resolves all of it once (``job_layout``) and hands the ``JobLayout`` to the engine,
the planner, context parallelism, the loader and the evaluator, which never derive it again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from yatrain.errors import ConfigError
from yatrain.recipe.checks import cuts_window
from yatrain.recipe.config import Recipe

NAMED_DIVISORS = 8  # an error line names at most this many


@dataclass(frozen=True)
class JobLayout:
    """How a job's ranks divide the work: every rank of a shard group holds a slice of each
    layer, replicas of the group hold the same slices, and CP consecutive ranks share each
    window (one data rank)."""

    world_size: int
    shard_group: int  # ranks that shard each layer; the world unless hybrid (HSDP)
    context: int  # ranks that share each window (sharding.context_parallel)
    local_world_size: int  # ranks on this node

    @property
    def replicas(self) -> int:
        return self.world_size // self.shard_group

    @property
    def data_ranks(self) -> int:
        """How many slices the global batch is cut into."""
        return self.world_size // self.context

    def data_rank(self, rank: int) -> int:
        """Which slice ``rank`` reads: a CP group's ranks share one."""
        return rank // self.context


def job_layout(
    recipe: Recipe, world_size: int, local_world_size: int, *, batch: bool = True
) -> JobLayout:
    """The recipe laid over this job (see the module docstring), or the one line that says
    why it cannot be: the batch, the CP size or the shard group does not divide. ``batch``:
    check the global batch too (a run's layout; an engine built alone reads no batches)."""
    context = context_parallel(recipe, world_size)
    if batch:
        _check_batch(recipe, world_size, context)
    group = shard_group_size(recipe, world_size, local_world_size)
    return JobLayout(world_size, group, context, local_world_size)


def validate_world_size(recipe: Recipe, world_size: int) -> None:
    """Check the global batch splits evenly into micro-batches across the data ranks (the
    world, or world / CP under context parallelism)."""
    _check_batch(recipe, world_size, context_parallel(recipe, world_size))


def _check_batch(recipe: Recipe, world_size: int, cp: int) -> None:
    data = recipe.data
    per_step = data.micro_batch_size * world_size // cp
    if data.global_batch_size % per_step == 0:
        return
    valid = batch_sizes_near(data.global_batch_size, per_step)
    ranks = f"world size ({world_size})"
    if cp > 1:
        ranks = f"data ranks (world size {world_size} / sharding.context_parallel {cp})"
    raise ConfigError(
        f"'data.global_batch_size' ({data.global_batch_size}) is not divisible by "
        f"data.micro_batch_size ({data.micro_batch_size}) x {ranks} = "
        f"{per_step}; set it to a multiple of {per_step} such as "
        f"{' or '.join(map(str, valid))}, or change data.micro_batch_size"
    )


def batch_sizes_near(global_batch_size: int, per_step: int) -> list[int]:
    """The two multiples of ``per_step`` (sequences a step of every data rank takes) that a
    refused global batch size lies between, to suggest in its place."""
    lower = global_batch_size // per_step * per_step
    return [lower, lower + per_step] if lower else [per_step, 2 * per_step]


def context_parallel(recipe: Recipe, world_size: int, plan: bool = False) -> int:
    """The ranks that share each window (``sharding.context_parallel``); one line if they
    cannot: more than one needs as many ranks, and a whole number of CP groups. ``plan``:
    the world is ``yatrain plan``'s ``--gpus`` and CP its ``--context-parallel``, and the
    line names those flags instead of a launch's."""
    cp = recipe.sharding.context_parallel
    if cp == 1:
        return 1
    if world_size == 1 and plan:
        raise ConfigError(
            f"'sharding.context_parallel' {cp} cuts each window over {cp} GPUs and this plan "
            f"is for one: plan for {cp} or a multiple (--gpus {cp}), or pass --context-parallel 1"
        )
    if world_size == 1:
        forced = " (sharding.force_process_group runs one rank)"
        forced = forced if recipe.sharding.force_process_group else ""
        raise ConfigError(
            f"'sharding.context_parallel' {cp} cuts each window over {cp} ranks and this run "
            f"has one{forced}: launch {cp} or a multiple (yatrain pretrain --nproc-per-node "
            f"{cp}), or set it to 1"
        )
    if world_size % cp:
        where = f"--gpus {world_size}" if plan else f"the world size ({world_size})"
        sizes = _named(cp_sizes(world_size, recipe.data.seq_len), world_size, cp)
        fix = f"pass --context-parallel {sizes}, or plan for a multiple of "
        fix = f"{fix}{cp} GPUs" if plan else f"set it to {sizes}"
        raise ConfigError(
            f"'sharding.context_parallel' {cp} does not divide {where}: {fix} (the world is "
            "data x context ranks)"
        )
    return cp


def shard_group_size(recipe: Recipe, world_size: int, local_world_size: int) -> int:
    """How many ranks shard each layer: the recipe's number, the node's ranks for "auto"
    (torchrun's local world size), the whole world when unset. One line if it does not
    divide the world."""
    wanted = recipe.sharding.shard_group_size
    if wanted is None:
        size = world_size  # the whole world shards
    elif wanted == "auto":
        size = local_world_size  # the node's ranks
    else:
        size = wanted
    cp = recipe.sharding.context_parallel
    if world_size % size == 0 and size % cp:
        if size == world_size:  # the whole world shards: its own line says what divides it
            context_parallel(recipe, world_size)
        raise ConfigError(
            f"'sharding.context_parallel' {cp} does not divide the shard group of {size} "
            f"ranks ('sharding.shard_group_size' {wanted}): a window's ranks must sit in one "
            f"shard group; set context_parallel to "
            f"{_named(cp_sizes(size, recipe.data.seq_len), size, cp)}"
        )
    if world_size % size == 0:
        return size
    sizes = _divisors(world_size, size)
    named = f"{wanted} (auto: {size} ranks per node)" if wanted == "auto" else str(wanted)
    raise ConfigError(
        f"'sharding.shard_group_size' {named} does not divide the world size ({world_size}); "
        f"set it to {sizes} (usually the GPUs per node), or remove it to shard over "
        "all ranks"
    )


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` in order, found up to its square root (a world of a billion
    ranks takes 32,000 steps, not a billion)."""
    small = [k for k in range(1, math.isqrt(n) + 1) if n % k == 0]
    return small + [n // k for k in reversed(small) if k * k != n]


def cp_sizes(ranks: int, seq_len: int) -> list[int]:
    """The CP sizes ``ranks`` ranks can take (divisors) that also cut a window of ``seq_len``
    tokens (``checks.cuts_window``): the only ones a refusal may suggest; 1 always can."""
    return [c for c in divisors(ranks) if cuts_window(seq_len, c)]


def _divisors(n: int, near: int) -> str:
    """``one of 1, 2, 4, 8``; of many, the few closest to the size that was asked."""
    return _named(divisors(n), n, near)


def _named(found: list[int], n: int, near: int) -> str:
    """``1``, ``one of 1, 2, 4, 8``; of many (divisors of ``n``), the few closest to
    ``near``, the size that was asked."""
    if len(found) == 1:
        return str(found[0])
    if len(found) <= NAMED_DIVISORS:
        return f"one of {', '.join(map(str, found))}"
    closest = sorted(sorted(found, key=lambda k: (abs(k - near), k))[:NAMED_DIVISORS])
    return f"a divisor of {n} such as {', '.join(map(str, closest))}"
