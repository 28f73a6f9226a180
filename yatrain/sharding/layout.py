"""Where each parameter of a unit lives inside its flat buffer, and which slice a rank owns.

A unit's parameters are laid end to end in one flat buffer, padded to a multiple of the
world size so that every rank owns one equal, contiguous shard. The layout is computed once
from parameter shapes (meta tensors are fine) and then used to cut views out of whatever
buffer currently holds the unit: a gather buffer, a gradient buffer, or a rank's shard.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ParamSlot:
    """One parameter: the module attribute it is bound to and its place in the flat buffer."""

    module: nn.Module
    attr: str
    name: str  # fully qualified name in the model, for state dicts and error messages
    shape: torch.Size
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class FlatLayout:
    """Parameters of one unit laid end to end and padded to a multiple of ``world_size``."""

    def __init__(self, slots: list[ParamSlot], world_size: int) -> None:
        self.slots = slots
        self.numel = sum(s.numel for s in slots)
        self.padded_numel = math.ceil(self.numel / world_size) * world_size
        self.shard_numel = self.padded_numel // world_size

    @classmethod
    def from_params(
        cls, named: list[tuple[str, nn.Module, str, torch.Tensor]], world_size: int
    ) -> FlatLayout:
        """Build from ``(qualified_name, module, attr, tensor)`` in a fixed order."""
        slots, offset = [], 0
        for name, module, attr, tensor in named:
            slots.append(ParamSlot(module, attr, name, tensor.shape, offset))
            offset += tensor.numel()
        return cls(slots, world_size)

    @property
    def single_tensor(self) -> bool:
        """One parameter only: autograd's own gradient tensor is the unit's whole gradient,
        so it needs no gradient buffer (sizes.py)."""
        return len(self.slots) == 1

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``flat`` shaped like each parameter (no copies)."""
        return [flat.narrow(0, s.offset, s.numel).view(s.shape) for s in self.slots]

    def shard_range(self, rank: int) -> tuple[int, int]:
        start = rank * self.shard_numel
        return start, start + self.shard_numel


def alias(buffer: torch.Tensor) -> torch.Tensor:
    """A tensor sharing ``buffer``'s memory but with its own autograd version counter.

    Collectives write into gather buffers in place, which bumps the buffer's version
    counter. Autograd would then reject weights saved for backward as "modified by an
    inplace operation" even though the engine re-gathers identical values before that
    layer's backward. Parameters are therefore cut from an alias: the engine, not the
    version counter, guarantees that a buffer holds the right unit when autograd reads it.
    """
    return torch.empty(0, dtype=buffer.dtype, device=buffer.device).set_(
        buffer.untyped_storage(), buffer.storage_offset(), buffer.shape, buffer.stride()
    )


def plan_layouts(
    model: nn.Module, units: Sequence[nn.Module], norms: Sequence[nn.Module], world_size: int
) -> tuple[list[FlatLayout], FlatLayout, int]:
    """Unit layouts (weights of rank >= 2) and the small group: norms first, then any other
    1-D tensor (biases); also returns how many small-group slots belong to norms."""
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    seen: set[int] = set()

    def collect(
        module: nn.Module, skip: set[int]
    ) -> list[tuple[str, nn.Module, str, torch.Tensor]]:
        found = []
        for sub in module.modules():
            for attr, param in sub.named_parameters(recurse=False):
                if id(param) in skip:
                    continue
                if id(param) in seen:
                    raise ValueError(f"parameter {names.get(id(param))} is shared; not supported")
                seen.add(id(param))
                found.append((names.get(id(param), attr), sub, attr, param))
        return found

    small = [entry for norm in norms for entry in collect(norm, set())]
    norm_ids = {id(entry[3]) for entry in small}
    per_unit, one_dim = [], []
    for unit in units:
        params = collect(unit, norm_ids)
        per_unit.append([e for e in params if e[3].ndim >= 2])
        one_dim.extend(e for e in params if e[3].ndim < 2)
    layouts = [FlatLayout.from_params(p, world_size) for p in per_unit]
    for index, layout in enumerate(layouts):
        if not layout.slots:
            raise ValueError(f"unit {index} has no weights outside the norm group")
    return layouts, FlatLayout.from_params(small + one_dim, world_size), len(small)
