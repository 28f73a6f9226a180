"""The engine's preallocated flat buffers and what each currently holds.

How many buffers of which size is decided in one place, ``sizes.engine_buffers`` (the
planner calls it too); this module allocates them and assigns units to them: gather
buffers rotate among consecutive units (the edge units either rotate with the others or
share one buffer of their own), and the units with several weight tensors take turns on
two gradient buffers.
"""

from __future__ import annotations

import torch

from yatrain.sharding.comm import Handle
from yatrain.sharding.layout import alias
from yatrain.sharding.reduce import ReduceJob
from yatrain.sharding.sizes import EngineBuffers


class Buffer:
    """A preallocated flat buffer and the unit whose data it holds (or is receiving)."""

    def __init__(self, data: torch.Tensor, owner: int | None = None, fixed: bool = False):
        self.data = data
        self.alias = alias(data)
        self.owner = owner
        self.fixed = fixed  # world size 1: the buffer *is* the unit's shard, always valid
        self.handle: Handle | None = None


class GradSlot:
    """A gradient buffer and the reduction still reading it."""

    def __init__(self, data: torch.Tensor):
        self.data = data
        self.job: ReduceJob | None = None


def edge_and_inner(n_units: int) -> tuple[list[int], list[int]]:
    """Indices of the edge units (first and last) and of the units between them."""
    edges = sorted({0, n_units - 1})
    return edges, [i for i in range(n_units) if i not in edges]


def gather_buffers(n_units: int, plan: EngineBuffers, device: torch.device) -> list[Buffer]:
    """The gather buffer of every unit, in forward order."""
    spec = plan.gather
    ring = [Buffer(spec.empty(device)) for _ in range(spec.count)]
    if not plan.edge_owns_gather:
        return [ring[i % len(ring)] for i in range(n_units)]
    edge = Buffer(plan.edge_gather.empty(device))
    edges, inner = edge_and_inner(n_units)
    buffer_of: list[Buffer] = [edge] * n_units
    for j, i in enumerate(inner):
        buffer_of[i] = ring[j % len(ring)]
    return buffer_of


def grad_slots(
    single_tensor: list[bool], plan: EngineBuffers, device: torch.device
) -> list[GradSlot | None]:
    """The gradient buffer of every unit with several weight tensors, taken in turns."""
    spec = plan.grad
    slots = [GradSlot(spec.empty(device)) for _ in range(spec.count)]
    slot_of: list[GradSlot | None] = []
    for single in single_tensor:
        if single or not slots:
            slot_of.append(None)
        else:
            slot_of.append(slots[sum(s is not None for s in slot_of) % len(slots)])
    return slot_of
