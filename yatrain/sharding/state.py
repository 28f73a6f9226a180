"""The engine's saved state, as the engine names it: one flat tensor per unit plus the small
group, each saved at its real (unpadded) length with every rank contributing its slice.

``StateEntry`` describes one flat tensor (its key, its global length, the parameters laid
end to end inside it); ``ShardView`` is one rank's piece of it with its global offset.
Ranks own contiguous ``torch.chunk`` slices, so each piece is the local part of a dim-0
sharded tensor: a checkpoint written at one world size can be re-cut at any other. Code
outside the engine reads and writes this state through these types only; the keys are
the engine's business.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from yatrain.sharding.comm import Communicator
from yatrain.sharding.contract import ShardableModel
from yatrain.sharding.layout import FlatLayout, plan_layouts

_SMALL_KEY = "small"


@dataclass(frozen=True)
class StateEntry:
    """One flat tensor of the saved state: ``numel`` elements holding ``params`` (name,
    shape, offset) end to end."""

    key: str
    numel: int
    params: tuple[tuple[str, torch.Size, int], ...]

    @classmethod
    def of(cls, key: str, layout: FlatLayout) -> StateEntry:
        params = tuple((s.name, s.shape, s.offset) for s in layout.slots)
        return cls(key, layout.numel, params)

    def split(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of a full flat tensor of this entry, one per parameter, by name."""
        return {
            name: flat.narrow(0, offset, shape.numel()).view(shape)
            for name, shape, offset in self.params
        }


@dataclass(frozen=True)
class ShardView:
    """This rank's real elements of one flat tensor: ``local`` starts at ``offset`` of a
    tensor of ``numel`` elements (a view into the engine's shard, no copy)."""

    local: torch.Tensor
    offset: int
    numel: int


def state_entries(layouts: list[FlatLayout], small: FlatLayout) -> list[StateEntry]:
    """The saved layout of an engine with these unit layouts and small group."""
    units = [
        StateEntry.of(f"unit.{index}", layout)
        for index, layout in enumerate(layouts)
        if layout.owns  # a tied unit is saved once, under the unit that owns it
    ]
    return [*units, StateEntry.of(_SMALL_KEY, small)]


def describe_state(model: ShardableModel) -> list[StateEntry]:
    """The saved layout of ``model``'s state without building an engine (for reading a
    checkpoint in one process: export, ``init_from``). A meta-device model is enough."""
    layouts, small, _ = plan_layouts(model, model.units(), model.norm_modules(), 1)
    return state_entries(layouts, small)


def shard_views(
    entries: list[StateEntry],
    layouts: list[FlatLayout],
    rank: int,
    pieces: list[torch.Tensor],
) -> dict[str, ShardView]:
    """This rank's real part of each entry, cut from ``pieces`` (each entry's padded shard)."""
    views = {}
    for entry, layout, piece in zip(entries, layouts, pieces, strict=True):
        start, _ = layout.shard_range(rank)
        real = max(0, min(layout.shard_numel, layout.numel - start))
        views[entry.key] = ShardView(piece[:real], min(start, layout.numel), layout.numel)
    return views


def sharded_views(
    entries: list[StateEntry],
    layouts: list[FlatLayout],
    rank: int,
    params: list[torch.Tensor],
    states: list[dict],
) -> dict[str, dict[str, ShardView]]:
    """``"model"``: this rank's piece of each entry's ``params``; and by state name (an
    optimizer's per-parameter state, ``states``) the pieces of every state tensor shaped
    like its parameter."""
    state = {"model": shard_views(entries, layouts, rank, params)}
    for entry, layout, param, held in zip(entries, layouts, params, states, strict=True):
        for name, value in held.items():
            if torch.is_tensor(value) and value.shape == param.shape:
                state.setdefault(name, {}).update(shard_views([entry], [layout], rank, [value]))
    return state


@torch.no_grad()
def gather_full(comm: Communicator, pairs: list[tuple[FlatLayout, torch.Tensor]]) -> dict:
    """Every parameter of each ``(layout, shard)`` in fp32 on CPU, gathered over ``comm`` one
    flat tensor at a time."""
    result: dict[str, torch.Tensor] = {}
    for layout, shard in pairs:
        full = torch.empty(layout.padded_numel, dtype=torch.float32, device=shard.device)
        comm.wait(comm.all_gather(full, shard))
        for slot, view in zip(layout.slots, layout.views(full), strict=True):
            result[slot.name] = view.detach().cpu().clone()
    return result
