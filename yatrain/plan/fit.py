"""A run's start asks the planner once: what ``activation_checkpoint_layers: auto`` is here,
and will a step's predicted peak fit the memory this device has?

``pretrain`` asks here before it allocates anything, so a recipe too big for the machine is
refused in a second with one line (the planner's peak, what is available, what would fit)
instead of failing in the allocator minutes later, or being killed by the kernel. What it
plans against is the run's ``MemoryBudget`` (``budget``) over its ``JobLayout``; on a GPU
one whole plan answers both questions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from yatrain.common import format_bytes
from yatrain.errors import ConfigError
from yatrain.plan.budget import MemoryBudget
from yatrain.plan.limits import plan_auto
from yatrain.plan.memory import MemoryPlan, plan_for_layers
from yatrain.plan.report import explain
from yatrain.plan.search import plan_memory
from yatrain.recipe.config import Recipe
from yatrain.recipe.topology import JobLayout, divisors


def start_plan(
    recipe: Recipe,
    layout: JobLayout,
    budget: MemoryBudget,
    fit: bool,
    say: Callable[[str], None],
) -> int:
    """The number of checkpointed layers this run uses (``auto`` resolved, its line told to
    ``say``); with ``fit``, a ConfigError when the step's peak does not fit ``budget``."""
    setting = recipe.sharding.activation_checkpoint_layers
    world, group = layout.world_size, layout.shard_group
    plan: MemoryPlan | None = None
    if setting == "auto":
        layers, line, plan = plan_auto(recipe, world, budget.limit, budget.source, group)
        say(line)
    else:
        layers = setting
    if fit and plan is not None and plan.fits is False and not budget.fit_is_auto_plan:
        raise ConfigError(  # a CPU planning for a GPU it set (a GPU's own check is below)
            f"sharding.activation_checkpoint_layers auto plans against {budget.source} "
            f"({format_bytes(budget.limit, 'GiB')}) and this run {explain(plan)}; raise or "
            "unset sharding.gpu_memory_gib (a CPU's fit check then compares with its RAM), "
            "--no-fit-check skips this check"
        )
    if not fit or budget.have is None:
        return layers
    if plan is None or not budget.fit_is_auto_plan:
        args = (budget.have, budget.allowance, budget.staging)
        plan = plan_for_layers(recipe, world, layers, *args, shard_group=group)
    if not plan.fits:
        local = layout.local_world_size if budget.shares_ram else None
        raise ConfigError(
            f"this run does not fit: the planner predicts a peak of "
            f"{format_bytes(plan.peak_bytes_per_gpu, 'GiB')} per device ({layers} of "
            f"{recipe.model.n_layers} layers checkpointed, {world} device(s)) and "
            f"{format_bytes(budget.have, 'GiB')} is available ({budget.have_source}): "
            f"{fit_advice(recipe, world, budget.have, budget.allowance, group, local)}; "
            "`yatrain plan` shows the breakdown, --no-fit-check skips this check"
        )
    return layers


def fit_advice(
    recipe: Recipe,
    world_size: int,
    have: int,
    allowance: int | None,
    shard_group: int | None = None,
    ram_ranks: int | None = None,
) -> str:
    """What would make it fit, by the planner: more checkpointed layers, the document
    mask's longest sequence, context parallelism, more devices, or a smaller micro-batch.
    ``ram_ranks``: on a CPU, the ranks that share this machine's RAM (more of them do not
    add any: ``ram_advice``)."""
    best = plan_memory(recipe, world_size, have, allowance, shard_group=shard_group)
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
    masked = document_mask_words(recipe, world_size, have, allowance, shard_group)
    if masked:
        return f"{masked}{', or ' + context if context else ''}"
    if context:
        return context
    if best.min_gpus is not None and best.shard_group_size < world_size:
        return f"use sharding.shard_group_size of at least {best.min_gpus} (or unset it)"
    if ram_ranks is not None:
        fewest = best.min_gpus
        return ram_advice(recipe, world_size, have, allowance, ram_ranks, fewest, shard_group)
    if best.min_gpus is not None:
        per_step = best.batch_for_min_gpus()
        batch = f" and data.global_batch_size a multiple of {per_step}" if per_step else ""
        return f"use at least {best.min_gpus} devices with all layers checkpointed{batch}"
    return "lower data.micro_batch_size or data.seq_len (no device count helps)"


def ram_advice(
    recipe: Recipe,
    world_size: int,
    have: int,
    allowance: int | None,
    ram_ranks: int,
    min_ranks: int | None,
    shard_group: int | None = None,
) -> str:
    """What helps a CPU run: its ranks share the machine's RAM, so more of them on it add
    none. The largest micro-batch that fits (with the fewest checkpointed layers), else a
    shorter sequence, else more machines like this one."""
    share = "ranks on one machine share its RAM, so more of them do not help"
    micro = largest_micro_batch(recipe, world_size, have, allowance, shard_group)
    if micro is not None:
        data = dataclasses.replace(recipe.data, micro_batch_size=micro)
        candidate = dataclasses.replace(recipe, data=data)
        plan = plan_memory(candidate, world_size, have, allowance, shard_group=shard_group)
        return (
            f"{share}: set data.micro_batch_size={micro} and "
            f"sharding.activation_checkpoint_layers={plan.activation_checkpoint_layers}"
        )
    machines = (
        f"run on at least {-(-min_ranks // ram_ranks)} machines like this one "
        f"({ram_ranks} rank{'s' * (ram_ranks > 1)} each)"
        if min_ranks is not None
        else ""
    )
    shortest = dataclasses.replace(
        recipe.data, micro_batch_size=1, seq_len=2 * recipe.sharding.context_parallel
    )
    state_only = dataclasses.replace(recipe, data=shortest)
    n = recipe.model.n_layers
    if plan_for_layers(state_only, world_size, n, have, allowance, shard_group=shard_group).fits:
        return (
            f"{share}: set data.micro_batch_size=1, sharding.activation_checkpoint_layers="
            f"{n} and a shorter data.seq_len{', or ' + machines if machines else ''}"
        )
    if machines:
        return (
            f"its state alone does not fit here and {share}: {machines}, or train a smaller model"
        )
    return f"its state alone does not fit here and {share}: train a smaller model"


def largest_micro_batch(
    recipe: Recipe,
    world_size: int,
    have: int,
    allowance: int | None,
    shard_group: int | None = None,
) -> int | None:
    """The largest micro-batch below the recipe's that still splits its global batch over
    the data ranks and fits with all layers checkpointed (a bisection: the peak only grows
    with the micro-batch); None if none does."""
    data, n = recipe.data, recipe.model.n_layers
    ranks = world_size // recipe.sharding.context_parallel
    if data.global_batch_size % ranks:
        return None
    sizes = [m for m in divisors(data.global_batch_size // ranks) if m < data.micro_batch_size]

    def fits(micro: int) -> bool:
        small = dataclasses.replace(recipe, data=dataclasses.replace(data, micro_batch_size=micro))
        args = (have, allowance)
        return bool(plan_for_layers(small, world_size, n, *args, shard_group=shard_group).fits)

    return _largest_fitting(sizes, fits)


def _largest_fitting(candidates: Sequence[int], fits: Callable[[int], bool]) -> int | None:
    """The largest of the ascending ``candidates`` that ``fits`` (a bisection: what fits is
    a prefix, the peak only growing with the candidate); None if none does."""
    low, high = 0, len(candidates)  # candidates[:low] fit, candidates[high:] do not
    while low < high:
        mid = (low + high) // 2
        low, high = (mid + 1, high) if fits(candidates[mid]) else (low, mid)
    return candidates[low - 1] if low else None


def longest_masked_window(
    recipe: Recipe,
    world_size: int,
    have: int,
    allowance: int | None,
    shard_group: int | None = None,
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
            shard_group=shard_group,
        )
        return bool(plan.fits)

    if fits(recipe.data.seq_len):
        return recipe.data.seq_len
    return _largest_fitting(range(step, recipe.data.seq_len, step), fits)


def document_mask_words(
    recipe: Recipe,
    world_size: int,
    have: int,
    allowance: int | None,
    shard_group: int | None = None,
) -> str | None:
    """When only the dense document mask keeps the run from fitting: its size, and the
    longest window at which it fits (``data.document_mask``)."""
    if not recipe.data.document_mask:
        return None
    data = dataclasses.replace(recipe.data, document_mask=False)
    unmasked = dataclasses.replace(recipe, data=data)
    if not plan_memory(unmasked, world_size, have, allowance, shard_group=shard_group).fits:
        return None
    plan = plan_for_layers(recipe, world_size, 0, shard_group=shard_group)
    mask = plan.breakdown.get("attention_masks", 0)
    longest = longest_masked_window(recipe, world_size, have, allowance, shard_group)
    within = f"at most {longest} tokens" if longest else "no window"
    return (
        f"data.document_mask builds a dense mask of {format_bytes(mask, 'GiB')} per "
        f"micro-batch at {recipe.data.seq_len} tokens and fits {within} here; set "
        f"data.document_mask: false or data.seq_len to at most that"
    )
