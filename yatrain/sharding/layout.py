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

from yatrain.sharding.contract import ShardableModel

# One parameter as found in the model: (qualified name, module, attribute, tensor).
Entry = tuple[str, nn.Module, str, torch.Tensor]


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

    def __init__(self, slots: list[ParamSlot], world_size: int, borrows: int | None = None) -> None:
        self.slots = slots
        # A unit made of another unit's parameters (a head tied to the embedding): it is
        # gathered from, and its gradient reduced into, unit ``borrows``' shard; it has no
        # shard, optimizer state or saved tensor of its own.
        self.borrows = borrows
        self.numel = sum(s.numel for s in slots)
        self.padded_numel = math.ceil(self.numel / world_size) * world_size
        self.shard_numel = self.padded_numel // world_size

    @classmethod
    def from_params(
        cls,
        named: list[Entry],
        world_size: int,
        borrows: int | None = None,
    ) -> FlatLayout:
        """Build from ``(qualified_name, module, attr, tensor)`` in a fixed order."""
        slots, offset = [], 0
        for name, module, attr, tensor in named:
            slots.append(ParamSlot(module, attr, name, tensor.shape, offset))
            offset += tensor.numel()
        return cls(slots, world_size, borrows)

    @property
    def owns(self) -> bool:
        """Holds its own shard (is not another unit's parameters)."""
        return self.borrows is None

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

    def pieces(self, rank: int) -> list[MatrixPiece]:
        """Which flat range of which parameter ``rank``'s shard holds (padding excluded):
        what an optimizer that needs whole matrices (Muon) exchanges."""
        start, end = self.shard_range(rank)
        found = []
        for index, slot in enumerate(self.slots):
            first, last = max(start, slot.offset), min(end, slot.offset + slot.numel)
            if first < last:
                found.append(MatrixPiece(index, first - start, first - slot.offset, last - first))
        return found


@dataclass(frozen=True)
class MatrixPiece:
    """``length`` elements of parameter ``slot`` (flattened), from ``in_matrix`` on, held
    at ``in_shard`` of a rank's shard of the unit."""

    slot: int
    in_shard: int
    in_matrix: int
    length: int


@dataclass(frozen=True)
class MatrixMap:
    """A unit's matrices (name, shape) and, for each rank of its shard group, the pieces of
    them that rank's shard holds (``FlatLayout.pieces``)."""

    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    pieces: tuple[tuple[MatrixPiece, ...], ...]  # by rank

    @classmethod
    def of(cls, layout: FlatLayout, shard_size: int) -> MatrixMap:
        pieces = tuple(tuple(layout.pieces(rank)) for rank in range(shard_size))
        slots = layout.slots
        return cls(tuple(s.name for s in slots), tuple(s.shape for s in slots), pieces)


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
    model: ShardableModel, units: Sequence[nn.Module], norms: Sequence[nn.Module], world_size: int
) -> tuple[list[FlatLayout], FlatLayout, int]:
    """Unit layouts (weights of rank >= 2) and the small group: norms first, then any other
    1-D tensor (biases); also returns how many small-group slots belong to norms.

    A unit whose parameters are exactly an earlier unit's (the same Parameter objects, in
    the same order: an output head tied to the embedding) borrows that unit's layout;
    any other sharing is refused."""
    names: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), name)  # a shared Parameter keeps its first name
    owner: dict[int, int] = {}  # parameter id -> the unit (or -1: the small group) holding it

    def collect(module: nn.Module, skip: set[int], unit: int) -> tuple[list[Entry], list[Entry]]:
        found: list[Entry] = []
        shared: list[Entry] = []
        for sub in module.modules():
            for attr, param in sub.named_parameters(recurse=False):
                if id(param) in skip:
                    continue
                (shared if id(param) in owner else found).append(
                    (names.get(id(param), attr), sub, attr, param)
                )
        for entry in found:
            owner[id(entry[3])] = unit
        return found, shared

    small = [entry for norm in norms for entry in collect(norm, set(), -1)[0]]
    norm_ids = {id(entry[3]) for entry in small}
    layouts: list[FlatLayout] = []
    one_dim: list[Entry] = []
    for index, unit in enumerate(units):
        params, shared = collect(unit, norm_ids, index)
        if shared:
            layouts.append(_borrowed(layouts, params, shared, owner, world_size))
            continue
        layouts.append(FlatLayout.from_params([e for e in params if e[3].ndim >= 2], world_size))
        one_dim.extend(e for e in params if e[3].ndim < 2)
    for index, layout in enumerate(layouts):
        if not layout.slots:
            raise ValueError(f"unit {index} has no weights outside the norm group")
    return layouts, FlatLayout.from_params(small + one_dim, world_size), len(small)


def _borrowed(
    layouts: list[FlatLayout],
    params: list[Entry],
    shared: list[Entry],
    owner: dict[int, int],
    world_size: int,
) -> FlatLayout:
    """The layout of a unit made only of an earlier unit's parameters, bound to its own
    modules; ValueError for any other sharing."""
    home = owner[id(shared[0][3])]
    theirs = layouts[home].slots if home >= 0 and layouts[home].owns else []
    if params or [id(e[3]) for e in shared] != [id(_param(slot)) for slot in theirs]:
        raise ValueError(
            f"parameter {shared[0][0]} is shared, but not as a whole unit tied to another; "
            "not supported"
        )
    return FlatLayout.from_params(shared, world_size, borrows=home)


def _param(slot: ParamSlot) -> torch.Tensor:
    return getattr(slot.module, slot.attr)
