"""Muon at scale on paper, for ``scripts/bench_optimizers.py`` (its docstring says what is
counted): the exchange planned for every rank as a run plans it, each owner's Newton-Schulz
FLOPs counted by torch, their time at a GPU's data-sheet peak."""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch.utils.flop_counter import FlopCounterMode

from bench.measure import table, verdict
from yatrain.common import DTYPES, format_bytes
from yatrain.models.llama import DecoderLayer, build_model, flops_per_token
from yatrain.optim.exchange_plan import ExchangePlan, assign_owners, bucket_numel, ns_cost
from yatrain.optim.newton_schulz import zeropower
from yatrain.plan import layout
from yatrain.plan.traffic import micro_batches, traffic
from yatrain.recipe.config import Recipe
from yatrain.runtime.device import PEAK_FLOPS
from yatrain.sharding.layout import MatrixMap

PAPER = ("recipes/llama3_70b.yaml:256", "recipes/llama3_8b.yaml:64")
GPU = "H100"  # PEAK_FLOPS's key: the GPU the paper part prices Newton-Schulz on
TARGET = 1.25  # the largest owner's load over the mean (issue 54, 70B on 256 ranks)


@functools.lru_cache(maxsize=32)
def ns_flops(shape: torch.Size, steps: int, dtype: torch.dtype) -> int:
    """One orthogonalisation's FLOPs, counted by torch on ``zeropower`` itself (meta)."""
    with FlopCounterMode(display=False) as counter:
        zeropower(torch.empty(shape, device="meta"), steps, dtype)
    return counter.get_total_flops()


def on_paper(recipe: Recipe, ranks: int) -> dict:
    """What Muon costs one step of ``recipe`` on ``ranks`` ranks (module docstring): the
    exchange planned for every rank as ``ShardedMuon`` plans it (buckets, HSDP split)."""
    layout.check_planned_layout(recipe, ranks, "--set sharding.shard_group_size=N")
    muon, group = recipe.optim.muon(), layout.planned_group(recipe, ranks)
    copies = ranks // group if muon["hsdp"] == "split" else 1  # replicas the owners span
    dtype, owners = DTYPES[muon["ns_dtype"]], group * copies
    units = build_model(recipe.model).units()  # meta: shapes only
    layouts, _ = layout.unit_layouts(recipe.model, group)
    decoder = [i for i, unit in enumerate(units) if isinstance(unit, DecoderLayer)]
    maps = [MatrixMap.of(layouts[i], group) for i in decoder]  # muon_for's routing
    numel = bucket_numel(muon["bucket_mib"], dtype)
    ranks_of = [(r, c) for c in range(copies) for r in range(group)]
    plans = [ExchangePlan(maps, r, group, c, copies, numel) for r, c in ranks_of]
    sent = [plan.bytes_sent(dtype) + plan.bytes_across(dtype) for plan in plans]
    shapes, plan = plans[0].shapes, plans[0]
    owner = [rank + group * copy for rank, copy in zip(plan.owner, plan.replica, strict=True)]
    counts = [sum(len(maps[u].shapes) for u in bucket.units) for bucket in plan.buckets]
    flops = [ns_flops(shape, muon["ns_steps"], dtype) for shape in shapes]
    bounds = [sum(counts[:b]) for b in range(len(counts) + 1)]
    buckets = [range(first, last) for first, last in zip(bounds, bounds[1:], strict=False)]
    path = sum(max(loads(flops, owner, owners, jobs)) for jobs in buckets)
    tokens = recipe.data.global_batch_size * recipe.data.seq_len // ranks  # a GPU's, a step
    model_flops = flops_per_token(recipe.model, recipe.data.seq_len) * tokens
    costs, mean = [ns_cost(shape) for shape in shapes], sum(flops) / owners
    adamw = dataclasses.replace(recipe, optim=dataclasses.replace(recipe.optim, name="adamw"))
    return {
        "group": group,
        "matrices": len(shapes),
        "owners": owners,
        "buckets": len(counts),
        "micro_batches": micro_batches(recipe, ranks),
        "rest": traffic(adamw, ranks, group),  # the step's collectives but Muon's exchange
        "sent_max": max(sent),
        "sent_mean": sum(sent) / len(sent),
        "flops_mean": mean,
        "flops_max": max(loads(flops, owner, owners)),
        "path": path,  # the buckets' owners one bucket after another
        "model_flops": model_flops,
        "peak": PEAK_FLOPS[GPU][muon["ns_dtype"]],
        "ns_dtype": muon["ns_dtype"],
        "step_s": model_flops / PEAK_FLOPS[GPU][recipe.train.dtype],
        "cost_ratio": max(loads(costs, owner, owners)) * owners / sum(costs),  # as chosen
        "by_flops": max(loads(flops, assign_owners(flops, owners, counts), owners)) / mean,
        "largest_ratio": max(flops) / mean,
    }


def loads(costs: list[int], owner: list[int], n: int, jobs: range | None = None) -> list[int]:
    """Each of ``n`` owners' sum of ``costs`` over ``jobs`` (all of them by default)."""
    load = [0] * n
    for job in jobs if jobs is not None else range(len(costs)):
        load[owner[job]] += costs[job]
    return load


BYTES = "recipe @ ranks | shard group, exchanged in | micro-batches | gathers + reduce-scatters"
BYTES += " per rank | Muon exchange per rank: max (mean) | exchange / the rest"
COMPUTE = "recipe @ ranks | matrices | NS TFLOP: busiest owner (mean) | NS TFLOP, bucket after"
COMPUTE += f" bucket | that at {GPU} peak, ms | the step's model FLOPs at peak, s | NS / step"
COMPUTE += " | busiest owner / mean: FLOPs (ns_cost) | owners by FLOPs instead | largest matrix"
COMPUTE += f" / mean | FLOPs <= {TARGET}x"


def paper_tables(rows: list[tuple[str, dict]]) -> str:
    """The bytes table and the compute table, a row per ``RECIPE:RANKS``."""
    bytes_rows, compute_rows = [], []
    for label, p in rows:
        rest = p["rest"].intra + p["rest"].cross
        sent = f"{format_bytes(p['sent_max'], digits=2)} ({format_bytes(p['sent_mean'], digits=2)})"
        share = f"{p['sent_max'] / rest:.3%}"
        group = f"{p['group']}, {p['buckets']} bucket(s)"
        bytes_rows.append([label, group, p["micro_batches"], format_bytes(rest), sent, share])
        ratio, seconds = p["flops_max"] / p["flops_mean"], p["path"] / p["peak"]
        if p["matrices"] >= p["owners"]:
            balance = verdict(ratio, TARGET)
        else:  # an owner per matrix at most: the largest matrix sets the largest load
            balance = f"ranks > matrices: the largest matrix, {p['largest_ratio']:.2f}x the mean"
        tflop = f"{p['flops_max'] / 1e12:.3g} ({p['flops_mean'] / 1e12:.3g})"
        ratios = f"{ratio:.3f}x ({p['cost_ratio']:.3f}x)"
        cells = [tflop, f"{p['path'] / 1e12:.3g}", f"{seconds * 1e3:.3g}", f"{p['step_s']:.3g}"]
        cells += [f"{seconds / p['step_s']:.2%}", ratios, f"{p['by_flops']:.3f}x"]
        compute_rows.append([label, p["matrices"], *cells, f"{p['largest_ratio']:.3f}x", balance])
    bytes_table = table(BYTES.split(" | "), bytes_rows)
    return f"{bytes_table}\n\n{table(COMPUTE.split(' | '), compute_rows)}"
