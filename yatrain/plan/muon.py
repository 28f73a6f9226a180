"""A Muon step on paper: what the optimizer holds beside the gradients while its exchange
peaks, and what the exchange sends, from the optimizer's own plan of it.

After the backward (the activations gone) ``ShardedMuon`` keeps, for every decoder layer's
shard, the update to orthogonalise and (the guard's skip flag is always handed over) the
copy of the weights the update lands in: two fp32 tensors of the rank's Muon shards
(``muon_shard_numel``). Its exchange then holds, bucket by bucket, the pieces sent and
received and the Newton-Schulz workspace of the largest owned matrix
(``optim.exchange_memory.exchange_peak_bytes``). Both come from an ``ExchangePlan`` built on
paper for rank 0 of replica 0, the rank a dry run runs by default (other ranks own other
matrices: their loads differ by at most one matrix's work).
"""

from __future__ import annotations

import functools
import json

from yatrain.common import DTYPES
from yatrain.optim.exchange_memory import exchange_peak_bytes
from yatrain.optim.exchange_plan import ExchangePlan, bucket_numel
from yatrain.plan.layout import model_key, unit_layouts
from yatrain.recipe.config import ModelConfig, Recipe
from yatrain.recipe.schema import build_dataclass
from yatrain.sharding.layout import MatrixMap


def muon_shard_numel(m: ModelConfig, group: int) -> int:
    """Elements of this rank's shards that a Muon run updates by Muon: the decoder layers'
    (units 1..n_layers; their norms are in the small group)."""
    layouts, _ = unit_layouts(m, group)
    return sum(layout.shard_numel for layout in layouts[1 : 1 + m.n_layers])


def muon_step_bytes(recipe: Recipe, world_size: int, group: int) -> int:
    """Bytes a Muon step holds beyond the resident state and the gradient shards at its
    exchange's peak (module docstring); 0 for AdamW."""
    if recipe.optim.name != "muon":
        return 0
    plan, itemsize = exchange_plan(recipe, world_size, group)
    return 2 * 4 * muon_shard_numel(recipe.model, group) + exchange_peak_bytes(plan, itemsize)


def exchange_plan(recipe: Recipe, world_size: int, group: int) -> tuple[ExchangePlan, int]:
    """Muon's exchange for rank 0 of ``recipe`` with shard groups of ``group`` out of
    ``world_size``, and its dtype's bytes per element."""
    muon = recipe.optim.muon()
    copies = world_size // group if muon["hsdp"] == "split" else 1
    key = model_key(recipe.model)
    plan = _plan(key, group, copies, muon["bucket_mib"], muon["ns_dtype"])
    return plan, DTYPES[muon["ns_dtype"]].itemsize


@functools.lru_cache(maxsize=16)
def _plan(model_items: str, group: int, copies: int, mib: float, dtype: str) -> ExchangePlan:
    m = build_dataclass(ModelConfig, json.loads(model_items))
    layouts, _ = unit_layouts(m, group)
    maps = [MatrixMap.of(layout, group) for layout in layouts[1 : 1 + m.n_layers]]
    return ExchangePlan(maps, 0, group, 0, copies, bucket_numel(mib, DTYPES[dtype]))
