"""Bytes one rank sends in a training step, within its shard group and across groups: one
pure function, which the planner calls and tests check against the engine's own count.

Ring accounting, with the engine's own ``comm.ring_bytes``: an all-gather or reduce-scatter
of a buffer of B bytes over W ranks sends (W-1)/W x B per rank; an all-reduce 2 (W-1)/W x B.
Per micro-batch each unit is gathered for its forward and again for its backward (when its
backward reads the weights; the engine skips the units still resident from the forward, so
this is an upper bound by at most ``prefetch_depth + 1`` units) and its gradient is
reduce-scattered; the norm group is gathered and reduced once per step. Under hybrid
sharding every fp32 gradient shard is then all-reduced once across the replicas. A Muon
step adds its two all-to-alls a bucket within the group (point to point: all but what a
rank keeps) and, with its owners split over the replicas, one a bucket across them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from yatrain.sharding.comm import ring_bytes
from yatrain.sharding.sizes import padded


@dataclass(frozen=True)
class StepTraffic:
    """Bytes one rank sends per optimizer step."""

    intra: int  # within its shard group: gathers and reduce-scatters
    cross: int  # across shard groups: the replicas' all-reduce (and Muon's split all-to-all)


def step_traffic(
    unit_numels: Sequence[int],
    reads_weights: Sequence[bool],
    small_numel: int,
    *,
    shard_size: int,
    replicas: int,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    micro_batches: int,
    fp8_units: Sequence[bool] = (),
    fp8_tensors: int = 0,
    exchanged: int = 0,
    across: int = 0,
) -> StepTraffic:
    """One rank's bytes for units of ``unit_numels`` elements (``reads_weights[i]``: unit i
    is gathered again for its backward) and a norm group of ``small_numel``. ``fp8_units``:
    units gathered in float8 (one byte per element), whose ``fp8_tensors`` weight tensors'
    amaxes are all-reduced once per step (float8.py). ``exchanged``: the bytes an optimizer
    exchanges point to point within the group (Muon's all-to-alls, ``MatrixExchange``'s
    ``bytes_sent``); ``across``: what it sends the other replicas (``bytes_across``: Muon's
    owners split over the world, ``optim.muon_hsdp: split``)."""
    g, p, r = shard_size, param_dtype.itemsize, reduce_dtype.itemsize
    sizes = [padded(n, g) for n in unit_numels]
    small = padded(small_numel, g)
    gathered = [1 if fp8 else p for fp8 in fp8_units] or [p] * len(sizes)
    per_micro = sum(
        ring_bytes(size * item, g) * (1 + reads) + ring_bytes(size * r, g)
        for size, reads, item in zip(sizes, reads_weights, gathered, strict=True)
    )
    scales = ring_bytes(2 * 4 * fp8_tensors, g)
    intra = micro_batches * per_micro + ring_bytes(small * p, g) + ring_bytes(small * r, g)
    intra += scales + exchanged
    shards = [size // g for size in sizes] + [small // g]
    cross = sum(ring_bytes(2 * 4 * n, replicas) for n in shards) if replicas > 1 else 0
    return StepTraffic(intra, cross + across)
