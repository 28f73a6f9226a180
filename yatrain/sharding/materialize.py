"""Build each rank's fp32 master shards from a meta-device model, one unit at a time.

Every rank materialises one unit (a unit borrowing another's parameters has nothing of
its own to materialise), lets the caller initialise it (deterministically per unit,
so the values do not depend on the world size), keeps only its own slice, and frees the unit
before the next: the full model never exists anywhere. Norms (and other 1-D tensors) form
the small group, which is small enough to assemble in full before slicing.

Modules are given memory by ``_materialize``, not ``nn.Module.to_empty``: each tensor still on
the meta device once (a norm its decoder layer already materialised is left alone), and by
replacing it rather than swapping it, which torch refuses under ``FakeTensorMode`` (its
converter keeps a weak reference to every fake parameter: "Couldn't swap Embedding.weight").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from yatrain.sharding.contract import Kept
from yatrain.sharding.layout import FlatLayout, ParamSlot


def materialize_shards(
    layouts: list[FlatLayout],
    small: FlatLayout,
    n_norm_slots: int,
    units: Sequence[nn.Module],
    norms: Sequence[nn.Module],
    *,
    init_unit: Callable[[int, Kept], None],
    init_norms: Callable[[], None],
    device: torch.device,
    rank: int,
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """(flat master of all unit shards, small-group master shard, each unit's offset).

    Afterwards the modules hold no parameters: the engine binds views before every use."""
    offsets: list[int] = []
    total = 0
    for layout in layouts:  # a borrowed unit's shard is its home's
        if layout.borrows is None:
            offsets.append(total)
            total += layout.shard_numel
        else:
            offsets.append(offsets[layout.borrows])
    master = torch.zeros(total, dtype=torch.float32, device=device)
    small_full = torch.zeros(small.padded_numel, device=device)
    norm_slots, other_small = small.slots[:n_norm_slots], small.slots[n_norm_slots:]
    for index, unit in enumerate(units):
        if not layouts[index].owns:  # its modules' attributes are bound before each use
            for slot in layouts[index].slots:
                delattr(slot.module, slot.attr)
            continue
        _materialize(unit, device)
        layout = layouts[index]
        start, end = layout.shard_range(rank)
        init_unit(index, _kept(layout.slots, start, end) | _kept(other_small, 0, small.numel))
        _copy_slots(layout.slots, master.narrow(0, offsets[index], layout.shard_numel), start, end)
        _copy_slots(other_small, small_full, 0, small.padded_numel)
        for slot in [*layout.slots, *other_small]:  # free this unit before the next
            tensor = getattr(slot.module, slot.attr, None)
            if tensor is not None and not tensor.is_meta:
                delattr(slot.module, slot.attr)
    for norm in norms:
        _materialize(norm, device)
    init_norms()
    _copy_slots(norm_slots, small_full, 0, small.padded_numel)
    for slot in norm_slots:
        delattr(slot.module, slot.attr)
    start, end = small.shard_range(rank)
    return master, small_full[start:end].clone(), offsets


def _materialize(module: nn.Module, device: torch.device) -> None:
    """Give each parameter and buffer of ``module`` that is still on the meta device new,
    uninitialised memory on ``device``; one tensor held by two modules stays shared."""
    new: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(meta) -> (meta, its memory)
    for sub in module.modules():
        named = [
            *sub.named_parameters(recurse=False, remove_duplicate=False),
            *sub.named_buffers(recurse=False, remove_duplicate=False),
        ]
        for name, tensor in named:
            if not tensor.is_meta:
                continue
            if id(tensor) not in new:
                memory = torch.empty_like(tensor, device=device)
                if isinstance(tensor, nn.Parameter):
                    memory = nn.Parameter(memory, requires_grad=tensor.requires_grad)
                new[id(tensor)] = (tensor, memory)
            setattr(sub, name, new[id(tensor)][1])  # a buffer stays a buffer


def _kept(slots: list[ParamSlot], start: int, end: int) -> dict[str, tuple[int, int]]:
    """For each slot overlapping [start, end) of its layout: the elements inside it."""
    kept = {}
    for slot in slots:
        lo, hi = max(start, slot.offset), min(end, slot.offset + slot.numel)
        if lo < hi:
            kept[slot.name] = (lo - slot.offset, hi - slot.offset)
    return kept


def _copy_slots(slots: list[ParamSlot], dest: torch.Tensor, start: int, end: int) -> None:
    """Copy the part of each materialised parameter that falls in [start, end) of the layout."""
    for slot in slots:
        tensor = getattr(slot.module, slot.attr, None)
        if tensor is None or tensor.is_meta:
            continue
        lo, hi = max(start, slot.offset), min(end, slot.offset + slot.numel)
        if lo < hi:
            flat = tensor.detach().reshape(-1)[lo - slot.offset : hi - slot.offset]
            dest[lo - start : hi - start].copy_(flat)
