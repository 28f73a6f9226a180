"""The planner's memory beside the engine benchmark's measured memory, per yatrain contender.

The one GPU figure so far checked the planner's tensor model (peak allocated through the
chunked loss against its tensors); nothing had measured its runtime allowance (CUDA context,
NCCL, the allocator's fragmentation: ``plan/memory.py``). This table does, on every GPU run
of ``scripts/bench_gpu.sh``: the planner's tensors against ``max_memory_allocated``, its
total (tensors + allowance) against ``max_memory_reserved`` and against the device memory the
run holds after its steps (``mem_get_info``: reserved + the CUDA context + NCCL's buffers).
At one rank; NCCL's share at 64 to 256 ranks stays an estimate.

Each contender is planned as ``yatrain pretrain`` would run it (``contender_recipe``); the
plain-loss contenders compute the whole micro-batch's logits at once, planned as one loss
chunk of that many tokens. On a CPU the measured side is the live-tensor peak (with
``--memtracker``) and the peak RSS above the process's size before the build.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from bench.engine.contenders import YATRAIN_VARIANTS, contender_recipe
from bench.measure import table
from yatrain.common import format_bytes
from yatrain.models.loss import model_loss
from yatrain.plan import MemoryPlan, plan_for_layers
from yatrain.plan.limits import memory_limit, staging_memory
from yatrain.recipe.config import Recipe


def planned_recipe(o: dict, name: str) -> tuple[Recipe, str]:
    """The recipe the planner sees for contender ``name``, and its loss in words."""
    variant = YATRAIN_VARIANTS[name]
    recipe = contender_recipe(
        o, variant.get("force", False), variant.get("compiled", False), variant.get("float8")
    )
    if variant.get("loss_fn") is model_loss:
        return recipe, f"chunked ({recipe.train.loss_chunk_tokens} tokens)"
    whole = o["seq_len"] * o["micro_batch"]  # the plain loss: every token's logits at once
    train = dataclasses.replace(recipe.train, loss_chunk_tokens=whole)
    return dataclasses.replace(recipe, train=train), f"plain (one chunk of {whole})"


def plan_contender(args: argparse.Namespace, recipe: Recipe) -> MemoryPlan:
    """The planner on this benchmark's device: on CUDA against the GPU's memory with its
    runtime allowance; on a CPU tensors only, as the CPU fit check plans."""
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    limit, allowance = (
        (memory_limit(recipe, device)[0], None) if args.device == "cuda" else (None, 0)
    )
    staging = staging_memory(recipe, device)  # what the engine sizes auto staging from
    return plan_for_layers(recipe, args.world_size, args.ac_layers, limit, allowance, staging)


def _size(n: float | None) -> str:
    return format_bytes(n, digits=2) if n else "n/a"


def _ratio(measured: float | None, planned: float | None) -> str:
    return f"{measured / planned:.3f}x" if measured and planned else "n/a"


def planned_vs_measured(args: argparse.Namespace, agg: dict[str, dict]) -> str | None:
    """The table (None without a yatrain contender)."""
    o = {k: v for k, v in vars(args).items() if k != "contenders"}
    names = [name for name in agg if name in YATRAIN_VARIANTS]
    if not names:
        return None
    cuda = args.device == "cuda"
    headers = ["contender", "loss planned as", "planned tensors", "planned total"]
    if cuda:
        headers += ["peak allocated", "alloc / tensors", "peak reserved", "reserved / total"]
        headers += ["device in use", "in use / total", "beyond tensors", "allowance"]
    else:
        headers += ["live-tensor peak", "live / tensors", "peak RSS above start", "RSS / tensors"]
    rows = []
    for name in names:
        recipe, loss = planned_recipe(o, name)
        plan = plan_contender(args, recipe)
        tensors, total, a = plan.tensor_peak_bytes, plan.peak_bytes_per_gpu, agg[name]
        row = [name, loss, _size(tensors), _size(total)]
        if cuda:
            alloc, reserved, used = a.get("mem_alloc"), a.get("mem_reserved"), a.get("device_used")
            beyond = used - alloc if used and alloc else None
            row += [_size(alloc), _ratio(alloc, tensors), _size(reserved), _ratio(reserved, total)]
            row += [_size(used), _ratio(used, total), _size(beyond)]
            row += [_size(plan.runtime_allowance_bytes)]
        else:
            live, rss = a.get("live_peak"), a.get("mem")
            row += [_size(live), _ratio(live, tensors), _size(rss), _ratio(rss, tensors)]
        rows.append(row)
    note = (
        "planned vs measured memory per rank (the planner's runtime allowance is measured by "
        "'beyond tensors': device in use minus peak allocated; at one rank, so NCCL's share "
        "at 64-256 ranks stays an estimate)"
        if cuda
        else "planned vs measured memory per rank (CPU: tensors only; the RSS also holds "
        "Python, torch and gloo)"
    )
    return note + "\n" + table(headers, rows)
