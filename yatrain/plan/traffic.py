"""Bytes one GPU sends per step: the engine's collectives from ``sharding.traffic.step_traffic``
over the layouts of a meta-device model, Muon's exchange from its plan (``plan/muon.py``),
context parallelism's K/V collectives."""

from __future__ import annotations

import dataclasses

from yatrain.common import DTYPES
from yatrain.plan.layout import fp8_units, model_key, unit_layouts, units_of
from yatrain.plan.muon import exchange_plan
from yatrain.recipe.config import ModelConfig, Recipe
from yatrain.sharding.traffic import StepTraffic, step_traffic


def _fp8_tensors(m: ModelConfig, fp8: tuple[bool, ...]) -> int:
    """How many tensors' amaxes the per-step scale all-reduce carries."""
    if not fp8:
        return 0
    layouts = unit_layouts(m, 1)[0]
    return sum(len(layout.slots) for layout, f in zip(layouts, fp8, strict=True) if f)


def traffic(recipe: Recipe, world_size: int, group: int) -> StepTraffic:
    """Bytes one GPU sends per step with shard groups of ``group`` out of ``world_size``."""
    numels, reads, small = units_of(model_key(recipe.model))
    fp8 = fp8_units(recipe.model, recipe.train.float8, group == 1)
    tensors = _fp8_tensors(recipe.model, fp8)
    return step_traffic(
        numels,
        reads,
        small,
        shard_size=group,
        replicas=world_size // group,
        param_dtype=DTYPES[recipe.train.dtype],
        reduce_dtype=DTYPES[recipe.sharding.reduce_dtype],
        micro_batches=micro_batches(recipe, world_size),
        fp8_units=fp8,
        fp8_tensors=tensors,
        **muon_traffic(recipe, world_size, group),
    )


def muon_traffic(recipe: Recipe, world_size: int, group: int) -> dict[str, int]:
    """Muon's exchange within the group and across replicas (none for AdamW)."""
    if recipe.optim.name != "muon" or group == 1:
        return {}
    plan, _ = exchange_plan(recipe, world_size, group)
    dtype = DTYPES[recipe.optim.muon()["ns_dtype"]]
    return {"exchanged": plan.bytes_sent(dtype), "across": plan.bytes_across(dtype)}


def micro_batches(recipe: Recipe, world_size: int) -> int:
    """Micro-batches a rank runs per step: the batch is split over world / CP data ranks."""
    data, cp = recipe.data, recipe.sharding.context_parallel
    return data.global_batch_size // (data.micro_batch_size * world_size // cp)


def context_bytes(recipe: Recipe, world_size: int, checkpointed: int) -> int:
    """Bytes one rank sends per step in context parallelism's K/V collectives: per
    micro-batch and layer one all-gather of its [2, B, kv heads, T / CP, head dim] keys and
    values (again in a checkpointed layer's recompute) and one reduce-scatter of their
    gradient, each sending (CP - 1) x its local part (ring accounting)."""
    m, data, cp = recipe.model, recipe.data, recipe.sharding.context_parallel
    if cp == 1:
        return 0
    local = 2 * data.micro_batch_size * m.n_kv_heads * data.seq_len // cp * m.head_dim
    local *= DTYPES[recipe.train.dtype].itemsize
    collectives = 2 * m.n_layers + checkpointed
    return micro_batches(recipe, world_size) * collectives * (cp - 1) * local


def traffic_table(
    recipe: Recipe, world_size: int, group: int, checkpointed: int = 0
) -> dict[str, dict[str, int]]:
    """Per-step bytes per GPU, within groups and across, for full sharding and (when the
    group is smaller than the world) hybrid sharding; under CP ``context``, the K/V
    collectives' share of ``intra`` (a CP group sits within a shard group)."""
    layouts = {"full": world_size, "hybrid": group} if group < world_size else {"full": group}
    kv = context_bytes(recipe, world_size, checkpointed)
    table = {}
    for name, size in layouts.items():
        sent = dataclasses.asdict(traffic(recipe, world_size, size))
        sent["intra"] += kv
        table[name] = {**sent, "context": kv} if kv else sent
    return table
