"""How a plan lays its GPUs out (the shard group) and the engine's layouts it plans with.

Hybrid sharding (``sharding.shard_group_size``) shards the state over the group, not the
world: the memory model plans for a shard group of G ranks, and the traffic table
(``plan/traffic.py``) compares full sharding over the world with G-rank groups replicated
world / G times. The layouts are the engine's own functions over a meta-device model: the
model owns its shapes, the engine its schedule.
"""

from __future__ import annotations

import functools
import json

from yatrain.errors import ConfigError
from yatrain.models.float8 import float8_projections
from yatrain.models.llama import Llama, build_model
from yatrain.recipe.config import ModelConfig, Recipe
from yatrain.recipe.schema import build_dataclass, to_dict
from yatrain.recipe.topology import (
    batch_sizes_near,
    context_parallel,
    cp_sizes,
    divisors,
    shard_group_size,
)
from yatrain.sharding.contract import backward_reads_weights
from yatrain.sharding.layout import FlatLayout, plan_layouts


def check_planned_layout(recipe: Recipe, gpus: int, group_fix: str) -> None:
    """What a plan for ``gpus`` GPUs cannot lay out, in the words of the planner's flags
    (``--gpus``, ``--context-parallel``), before a run's words could name a launch's. A plan
    runs on no node, so ``shard_group_size: auto`` (the node's GPUs) is refused rather than
    planned as full sharding; ``group_fix``: how the command sets a number instead."""
    if recipe.sharding.shard_group_size == "auto":
        raise ConfigError(
            "'sharding.shard_group_size: auto' is the GPUs per node, which a plan cannot see "
            f"here; pass {group_fix}"
        )
    _check_planned_context(recipe, gpus)
    context_parallel(recipe, gpus, plan=True)
    _check_planned_batch(recipe, gpus)
    _check_planned_group(recipe, gpus)


NAMED = 4  # a refusal names at most this many GPU counts or CP sizes: the closest


def _either(items: list[int], near: int) -> str:
    """``1``, ``1 or 2``, ``2, 4 or 8``: of many, the few closest to ``near``."""
    few = sorted(sorted(items, key=lambda k: (abs(k - near), k))[:NAMED])
    words = [str(k) for k in few]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def _cut_sizes(recipe: Recipe, ranks: int) -> str:
    """The CP sizes ``ranks`` GPUs can take that also cut the sequence into 2 x CP equal
    chunks (the recipe's next check, ``checks.cuts_window``); 1 always can."""
    return _either(cp_sizes(ranks, recipe.data.seq_len), recipe.sharding.context_parallel)


def _check_planned_context(recipe: Recipe, gpus: int) -> None:
    """A CP size that does not divide the GPUs, and the sizes that would (not every divisor
    of the GPUs: 131,072 tokens cannot be cut over 3)."""
    cp = recipe.sharding.context_parallel
    if gpus == 1 or gpus % cp == 0:  # one GPU: topology's own line (plan for CP GPUs)
        return
    raise ConfigError(
        f"'sharding.context_parallel' {cp} does not divide --gpus {gpus}: pass "
        f"--context-parallel {_cut_sizes(recipe, gpus)}, or plan for a multiple of {cp} GPUs "
        "(the world is data x context ranks)"
    )


def _check_planned_group(recipe: Recipe, gpus: int) -> None:
    """A CP size that does not divide a hybrid shard group, in the planner's words."""
    group, cp = recipe.sharding.shard_group_size, recipe.sharding.context_parallel
    if not isinstance(group, int) or gpus % group or group % cp == 0:
        return  # the world's own check (and topology's lines for a group that does not fit)
    raise ConfigError(
        f"'sharding.context_parallel' {cp} does not divide the shard group of {group} GPUs "
        f"('sharding.shard_group_size' {group}): a window's GPUs must sit in one shard group; "
        f"pass --context-parallel {_cut_sizes(recipe, group)}"
    )


def _check_planned_batch(recipe: Recipe, gpus: int) -> None:
    """The global batch must split over the data ranks, as a run's layout checks
    (``topology.validate_world_size``): a plan for a count that cannot is refused, naming
    the counts that can."""
    data, cp = recipe.data, recipe.sharding.context_parallel
    ranks = gpus // cp
    per_step = data.micro_batch_size * ranks
    if data.global_batch_size % per_step == 0:
        return
    counts = [d * cp for d in divisors(data.global_batch_size // data.micro_batch_size)]
    group = recipe.sharding.shard_group_size
    counts = [c for c in counts if not isinstance(group, int) or c % group == 0]
    named = f"plan for --gpus {_either(counts, gpus)}, or " if counts else ""
    multiples = batch_sizes_near(data.global_batch_size, per_step)
    over = f"--gpus {gpus}"
    if cp > 1:
        over = f"{ranks} data ranks (--gpus {gpus} / --context-parallel {cp})"
    raise ConfigError(
        f"'data.global_batch_size' ({data.global_batch_size}) is not divisible by "
        f"data.micro_batch_size ({data.micro_batch_size}) x {over} = {per_step}, so pretrain "
        f"would refuse this layout: {named}set "
        f"data.global_batch_size to a multiple of {per_step} such as "
        f"{' or '.join(map(str, multiples))}"
    )


def planned_group(recipe: Recipe, world_size: int, shard_group: int | None = None) -> int:
    """The shard group a plan for ``world_size`` GPUs uses: a run's, resolved once at its
    start (``topology.job_layout``), else the recipe's over GPUs on one node ("auto": all
    of them, as on the one machine a sweep runs on); one line if it does not divide."""
    if shard_group is not None:
        return shard_group
    return shard_group_size(recipe, world_size, local_world_size=world_size)


@functools.lru_cache(maxsize=8)
def _meta_model(model_items: str) -> Llama:
    """The model on the meta device (shapes only), built once per model config."""
    return build_model(build_dataclass(ModelConfig, json.loads(model_items)))


@functools.lru_cache(maxsize=256)
def _layouts(model_items: str, world: int) -> tuple[list[FlatLayout], FlatLayout]:
    model = _meta_model(model_items)
    layouts, small, _ = plan_layouts(model, model.units(), model.norm_modules(), world)
    return layouts, small


def unit_layouts(m: ModelConfig, world: int) -> tuple[list[FlatLayout], FlatLayout]:
    """The engine's layouts of the units and of the norm group over ``world`` ranks."""
    return _layouts(model_key(m), world)


@functools.lru_cache(maxsize=64)
def units_of(model_items: str) -> tuple[list[int], list[bool], int]:
    """Each unit's flat length and whether its backward reads its weights, and the norm
    group's length, as the engine lays them out."""
    layouts, small = _layouts(model_items, 1)
    reads = [backward_reads_weights(unit) for unit in _meta_model(model_items).units()]
    return [layout.numel for layout in layouts], reads, small.numel


@functools.lru_cache(maxsize=64)
def _fp8_units(model_items: str) -> tuple[bool, ...]:
    """Which units are made only of float8 projections: what a tensorwise run gathers in
    float8 (the engine's rule, ``sharding/float8.py``, over ``models/float8.py``'s modules)."""
    model = _meta_model(model_items)
    fp8 = {id(linear.weight) for _, linear in float8_projections(model)}
    return tuple(
        all(id(p) in fp8 for p in unit.parameters() if p.ndim >= 2) for unit in model.units()
    )


def fp8_units(m: ModelConfig, float8: str | None, direct: bool) -> tuple[bool, ...]:
    """Units gathered in float8 with ``train.float8`` (none without a gather: ``direct``)."""
    if float8 != "tensorwise" or direct:
        return ()
    return _fp8_units(model_key(m))


def model_key(m: ModelConfig) -> str:
    return json.dumps(to_dict(m), sort_keys=True)  # a hashable key (the config is mutable)
