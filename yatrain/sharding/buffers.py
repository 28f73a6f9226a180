"""The engine's preallocated flat buffers, what each currently holds, and how many it needs.

Gather buffers: ``prefetch_depth + 1`` for the inner units (decoder layers), rotated in
order, plus one for the edge units (first and last: embedding and output head), so a large
vocabulary does not inflate every layer buffer. Gradient slots: two for the inner units,
one for the edges, each with its shard-sized reduce-scatter output and, when gradients are
reduced in another dtype than they are computed in, a staging buffer (one shared by the two
inner slots).
"""

from __future__ import annotations

import torch

from yatrain.sharding.comm import Handle
from yatrain.sharding.layout import FlatLayout, alias


class Buffer:
    """A preallocated flat buffer and the unit whose data it holds (or is receiving)."""

    def __init__(self, data: torch.Tensor, owner: int | None = None, fixed: bool = False):
        self.data = data
        self.alias = alias(data)
        self.owner = owner
        self.fixed = fixed  # world size 1: the buffer *is* the unit's shard, always valid
        self.handle: Handle | None = None


class GradSlot:
    """A gradient buffer, the shard-sized reduce-scatter output, and the last RS using them."""

    def __init__(self, data: torch.Tensor, out: torch.Tensor, staging: torch.Tensor | None):
        self.data = data
        self.alias = alias(data)
        self.out = out
        self.staging = staging
        self.handle: Handle | None = None


def edge_and_inner(n_units: int) -> tuple[list[int], list[int]]:
    """Indices of the edge units (first and last) and of the units between them."""
    edges = sorted({0, n_units - 1})
    return edges, [i for i in range(n_units) if i not in edges]


def gather_buffers(
    layouts: list[FlatLayout], prefetch_depth: int, dtype: torch.dtype, device: torch.device
) -> list[Buffer]:
    """The gather buffer of every unit (units share buffers; see the module docstring)."""
    edges, inner = edge_and_inner(len(layouts))
    buffer_of: list[Buffer] = [None] * len(layouts)  # type: ignore[list-item]
    edge = Buffer(_zeros(max(layouts[i].padded_numel for i in edges), dtype, device))
    for i in edges:
        buffer_of[i] = edge
    if inner:
        size = max(layouts[i].padded_numel for i in inner)
        ring = [Buffer(_zeros(size, dtype, device)) for _ in range(prefetch_depth + 1)]
        for j, i in enumerate(inner):
            buffer_of[i] = ring[j % len(ring)]
    return buffer_of


def grad_slots(
    layouts: list[FlatLayout],
    dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    staging: bool,
    device: torch.device,
) -> list[GradSlot]:
    """The gradient slot of every unit (units share slots; see the module docstring)."""

    def full(units: list[int]) -> int:
        return max(layouts[i].padded_numel for i in units)

    def stage(units: list[int]) -> torch.Tensor | None:
        return _zeros(full(units), reduce_dtype, device) if staging else None

    def slot(units: list[int], stage: torch.Tensor | None) -> GradSlot:
        shard = max(layouts[i].shard_numel for i in units)
        out = _zeros(shard, reduce_dtype, device)
        return GradSlot(_zeros(full(units), dtype, device), out, stage)

    edges, inner = edge_and_inner(len(layouts))
    slot_of: list[GradSlot] = [None] * len(layouts)  # type: ignore[list-item]
    edge = slot(edges, stage(edges))
    for i in edges:
        slot_of[i] = edge
    if inner:
        shared = stage(inner)  # one staging buffer for both inner slots
        pair = [slot(inner, shared), slot(inner, shared)]
        for j, i in enumerate(inner):
            slot_of[i] = pair[j % 2]
    return slot_of


def _zeros(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.zeros(n, dtype=dtype, device=device)
