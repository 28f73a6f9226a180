"""The planner's answer in words: one line for logs, a per-item report for ``yatrain plan``."""

from __future__ import annotations

from pathlib import Path

from yatrain.common import format_bytes
from yatrain.models.llama import count_parameters
from yatrain.plan.memory import MemoryPlan
from yatrain.recipe.config import Recipe

LABELS = {
    "master_weights": "fp32 master weights (shard)",
    "optimizer_state": "AdamW moments (2 x fp32 shard)",
    "compute_copy": "bf16 copy of the weights (one process)",
    "gather_buffers": "gather buffers (units, norms)",
    "gradient_buffers": "gradient buffers (+ reduce staging)",
    "batch_and_rope": "token ids and rotary tables",
    "attention_masks": "attention masks (one micro-batch)",
    "activations": "activations",
    "logits_and_loss": "logits and loss (one chunk)",
    "head_gradient": "output head gradient (until reduced)",
    "backward_workspace": "backward workspace",
    "gradients": "fp32 gradients (shard, while alive)",
    "optimizer_workspace": "Muon updates, exchange, Newton-Schulz",
    "runtime_allowance": "runtime allowance (CUDA, NCCL, frag.)",
}


def _gib(n: float) -> str:
    return format_bytes(n, "GiB", suffix=False)


def explain(plan: MemoryPlan) -> str:
    """One line: the choice and why."""
    n, k = plan.n_layers, plan.activation_checkpoint_layers
    limit = plan.gpu_memory_bytes
    peak = f"predicted peak {format_bytes(plan.peak_bytes_per_gpu, 'GiB')} per GPU"
    if limit is None:
        return f"{k} of {n} layers checkpointed: {peak} (no memory limit given)"
    if not plan.fits and not plan.min_gpus and plan.runtime_allowance_bytes >= limit:
        return (
            f"does not fit: {allowance_words(plan)} fills the {format_bytes(limit, 'GiB')} per "
            "GPU before any tensor; lower the allowance or plan for more memory"
        )
    if not plan.fits:
        need = (
            f"needs {_group_words(plan)}at least {plan.min_gpus} GPUs{_divisor(plan)}"
            f"{_batch_words(plan)}"
            if plan.min_gpus
            else "no GPU count helps: lower data.micro_batch_size or data.seq_len"
            + (f", or {allowance_words(plan)}" if 2 * plan.runtime_allowance_bytes > limit else "")
        )
        return (
            f"does not fit even with all {n} layers checkpointed ({peak} > "
            f"{format_bytes(limit, 'GiB')} on {plan.world_size} GPUs): "
            f"{_context_words(plan)}{need}"
        )
    cost = f"recompute +{plan.recompute_flops_fraction:.1%} of step FLOPs"
    return (
        f"checkpoint the first {k} of {n} layers: {peak} of {format_bytes(limit, 'GiB')} ({cost})"
    )


def allowance_words(plan: MemoryPlan) -> str:
    """The runtime allowance, when it alone fills the GPU: no layout or batch helps."""
    allowance = format_bytes(plan.runtime_allowance_bytes, "GiB")
    return f"the runtime allowance ({allowance} for CUDA, NCCL, fragmentation; --runtime-allowance)"


def _context_words(plan: MemoryPlan) -> str:
    """The smallest context-parallel size that fits these GPUs, when one does."""
    smallest = plan.min_context_parallel
    if not smallest:
        return ""
    cp, k = smallest["context_parallel"], smallest["activation_checkpoint_layers"]
    return (
        f"fits with sharding.context_parallel {cp} (--context-parallel {cp}; checkpoint "
        f"{k} of {plan.n_layers} layers), or "
    )


def _batch_words(plan: MemoryPlan) -> str:
    """A count of GPUs that fits but cannot split the recipe's global batch says so."""
    per_step = plan.batch_for_min_gpus()
    return f" (and data.global_batch_size a multiple of {per_step})" if per_step else ""


def _group_words(plan: MemoryPlan) -> str:
    return "shard groups of " if plan.shard_group_size < plan.world_size else ""


def _divisor(plan: MemoryPlan) -> str:
    """Under hybrid sharding, the smallest group of at least ``min_gpus`` that divides the
    world (a group must)."""
    world = plan.world_size
    if plan.shard_group_size == world or not plan.min_gpus or plan.min_gpus > world:
        return ""
    size = next(d for d in range(plan.min_gpus, world + 1) if world % d == 0)
    return f" (shard_group_size {size} at {world} GPUs)"


def layout_words(plan: MemoryPlan) -> str:
    """``256 GPUs`` or ``256 GPUs as 32 replicas of shard groups of 8``."""
    group, world = plan.shard_group_size, plan.world_size
    hybrid = f" as {world // group} replicas of shard groups of {group}" if group < world else ""
    return f"{world} GPUs{hybrid}"


def _context_head(plan: MemoryPlan) -> str:
    cp = plan.context_parallel
    if cp == 1:
        return ""
    return f", context parallel {cp} ({plan.seq_len // cp} tokens of each window a GPU)"


def traffic_lines(plan: MemoryPlan) -> list[str]:
    """The per-step traffic table: full sharding against the recipe's hybrid layout."""
    rows = {
        "full": f"full sharding over {plan.world_size}",
        "hybrid": f"hybrid, groups of {plan.shard_group_size}",
    }
    lines = [
        "per-step bytes sent per GPU (ring accounting; every backward re-gather counted):",
        f"  {'layout':<30} {'within groups':>14} {'across groups':>14}",
    ]
    for name, sent in plan.traffic.items():
        lines.append(
            f"  {rows[name]:<30} {_gib(sent['intra']):>10} GiB {_gib(sent['cross']):>10} GiB"
        )
    kv = plan.traffic.get("full", {}).get("context", 0)
    if kv:
        lines.append(f"  (within groups: {_gib(kv)} GiB of it context parallelism's K/V)")
    if "hybrid" not in plan.traffic:
        lines.append(
            "  (full sharding: every collective spans all GPUs; "
            "--shard-group-size N compares hybrid sharding)"
        )
    return lines


def staging_line(plan: MemoryPlan, recipe: Recipe) -> list[str]:
    """The reduce-scatter staging and the pieces it cuts each unit's gradient into."""
    pieces = plan.staging.get("pieces")
    if not pieces:  # one process: nothing to reduce
        return []
    low, high = min(pieces), max(pieces)
    count = f"{low}" if low == high else f"{low}-{high}"
    setting = recipe.sharding.reduce_staging_mib
    return [
        f"reduce-scatter staging: {format_bytes(plan.staging['bytes'], 'MiB')} of a "
        f"{format_bytes(plan.staging['budget'], 'MiB')} budget (sharding.reduce_staging_mib "
        f"{setting}): {count} reduce-scatter(s) per unit and micro-batch"
    ]


def format_plan(plan: MemoryPlan, recipe: Recipe, recipe_path: Path, source: str) -> str:
    """The human-readable report of ``yatrain plan``."""
    k, n = plan.activation_checkpoint_layers, plan.n_layers
    params = count_parameters(recipe.model) / 1e9
    head = (
        f"{recipe_path.name}: {params:.2f}B parameters, {n} layers | seq {plan.seq_len} x "
        f"micro-batch {plan.micro_batch_size} | {plan.dtype} weights, "
        f"{recipe.sharding.reduce_dtype} reduce{' | compiled layers' * recipe.train.compile}"
        f"{f' | float8 {recipe.train.float8}' if recipe.train.float8 else ''}\n"
        f"{layout_words(plan)}{_context_head(plan)} x "
        f"{_gib(plan.gpu_memory_bytes)} GiB ({source})"
    )
    moment = plan.peak_moment
    if moment.startswith("recompute of layer"):
        acts = f"activations ({int(moment.split()[-1]) + 1} ckpt inputs + 1 recomputed)"
    elif moment.startswith("backward of layer"):
        acts = f"activations ({int(moment.split()[-1]) - k + 1} full + {k} checkpointed)"
    elif moment == "gradient norm":
        acts = "activations (all freed by then)"
    else:
        acts = f"activations ({n - k} full + {k} checkpointed)"
    lines = [
        head,
        f"per-GPU memory, first {k} of {n} layers checkpointed (peak at: {plan.peak_moment})",
    ]
    for key, value in plan.breakdown.items():
        label = acts if key == "activations" else LABELS.get(key, key)
        if key == "optimizer_state" and recipe.optim.name == "muon":
            label = "optimizer state (Muon: 1, AdamW: 2 x fp32)"
        lines.append(f"  {label:<44} {_gib(value):>8} GiB")
    verdict = "fits" if plan.fits else "DOES NOT FIT"
    full = format_bytes(plan.full_layer_bytes, "GiB", digits=3)
    ckpt = format_bytes(plan.checkpointed_layer_bytes, "GiB", digits=3)
    lines += [
        "  " + "-" * 57,
        f"  {'peak':<44} {_gib(plan.peak_bytes_per_gpu):>8} GiB of "
        f"{_gib(plan.gpu_memory_bytes)}: {verdict}",
        f"per decoder layer: {full} of activations, {ckpt} when checkpointed",
        *_muon_line(plan),
        *staging_line(plan, recipe),
        f"answer: {explain(plan)}",
    ]
    own = plan.recipe_setting
    if own.get("activation_checkpoint_layers") is not None:
        state = "fits" if own["fits"] else "does not fit"
        setting = own["activation_checkpoint_layers"]
        resolved = f" ({own['resolved_layers']} here)" if setting == "auto" else ""
        lines.append(
            f"recipe: activation_checkpoint_layers {setting}{resolved} -> "
            f"peak {format_bytes(own['peak_bytes_per_gpu'], 'GiB')} ({state})"
        )
    return "\n".join([*lines, *traffic_lines(plan)])


def _muon_line(plan: MemoryPlan) -> list[str]:
    """A Muon step's own moment, which the peak above may not be (plan/muon.py)."""
    if not plan.optimizer_step_bytes:
        return []
    step = format_bytes(plan.optimizer_step_bytes, "GiB", digits=3)
    where = "the peak" if plan.peak_moment == "optimizer step" else "below the peak"
    return [
        f"Muon step (after the backward, {where}): {step} of updates, exchange buffers "
        "and Newton-Schulz workspace beside every gradient shard"
    ]
