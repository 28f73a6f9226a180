"""Gathering a unit's weights into its buffer, ahead of use, and binding the norm group.

A gather is issued into the unit's gather buffer (``buffers.py``) unless the buffer already
holds that unit; the hooks (``hooks.py``) wait on it right before the unit computes and
issue the next ``prefetch_depth`` units' gathers behind it, in forward order on the way
forward and backward order on the way back (passing over units whose backward reads no
weights). A unit gathered in float8 (``float8.py``) is cast into this rank's slice of its
buffer and gathered as bytes. The norm group is gathered once per step and bound to its
modules with its gradient buffer as their ``.grad``.
"""

from __future__ import annotations

import functools

import torch

from yatrain.sharding.buffers import Buffer
from yatrain.sharding.comm import Communicator
from yatrain.sharding.float8 import Float8Gathers
from yatrain.sharding.layout import FlatLayout, alias


class UnitGathers:
    """Issues and waits on the units' gathers; counts the bytes each unit's gathers send."""

    def __init__(
        self,
        comm: Communicator,
        layouts: list[FlatLayout],
        unit_master: list[torch.Tensor],
        buffer_of: list[Buffer],
        *,
        reads_weights: list[bool],
        prefetch_depth: int,
        float8: Float8Gathers | None,
    ) -> None:
        self.comm, self.layouts, self.unit_master = comm, layouts, unit_master
        self.buffer_of, self.reads_weights = buffer_of, reads_weights
        self.prefetch_depth, self.float8 = prefetch_depth, float8
        self.n_units = len(layouts)
        self.gathered_bytes = [0] * self.n_units  # sent in each unit's gathers (benchmarks)

    def gather(self, unit: int) -> None:
        """Issue ``unit``'s gather into its buffer, unless the buffer holds it already."""
        buf = self.buffer_of[unit]
        if buf.owner == unit:
            return
        buf.owner = unit
        layout, shard = self.layouts[unit], self.unit_master[unit]
        sent = self.comm.bytes_sent
        float8 = self.float8
        if float8 is not None and float8.gathers(unit):
            full = buf.data.view(torch.uint8)[: layout.padded_numel]
            own = full.narrow(0, self.comm.rank * layout.shard_numel, layout.shard_numel)
            if not float8.fresh:
                float8.refresh(self.unit_master, self.comm.all_reduce_max)
            cast = functools.partial(float8.cast, unit, shard, own)
            buf.handle = self.comm.all_gather(full, own, fill=cast)
        else:
            full = buf.data[: layout.padded_numel]
            buf.handle = self.comm.all_gather(full, shard)  # casts in place (bf16)
        self.gathered_bytes[unit] += self.comm.bytes_sent - sent

    def ensure_gathered(self, unit: int) -> torch.Tensor:
        """``unit``'s full flat weights, gathered and waited for (an alias of its buffer)."""
        self.gather(unit)
        buf = self.buffer_of[unit]
        self.comm.wait(buf.handle)
        return buf.alias

    def prefetch(self, unit: int, step: int) -> None:
        """Issue the next units' gathers (forward: step=+1, backward: -1) ahead of use;
        in backward, units that read no weights there are passed over."""
        target, issued = unit, 0
        while issued < self.prefetch_depth:
            target += step
            if not 0 <= target < self.n_units:
                return
            if step < 0 and not self.reads_weights[target]:
                continue
            owner = self.buffer_of[target].owner
            busy = owner == unit if step > 0 else owner is not None and owner <= unit
            if owner != target and busy:
                return  # keep order: never skip one unit to gather a later one
            self.gather(target)
            issued += 1

    def weights(self, unit: int, flat: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]:
        """The weights of ``unit`` over its gathered ``flat`` buffer, one per parameter."""
        layout = self.layouts[unit]
        if self.float8 is not None and self.float8.gathers(unit):
            return self.float8.weights(unit, layout, flat.view(torch.uint8), dtype)
        return layout.views(flat)


def bind_small_group(
    comm: Communicator,
    small: FlatLayout,
    buffer: torch.Tensor,
    master: torch.Tensor,
    grad: torch.Tensor,
    *,
    direct: bool,
) -> None:
    """Gather the norm group's ``master`` shard into ``buffer`` (not when ``direct``: the
    buffer is the shard) and bind its views to the modules, ``grad``'s views as their
    ``.grad`` (autograd accumulates into them over the step's micro-batches)."""
    if not direct:
        comm.wait(comm.all_gather(buffer, master))
    for slot, view, slot_grad in zip(
        small.slots,
        small.views(alias(buffer)),
        small.views(alias(grad)),
        strict=True,
    ):
        view.requires_grad_(True)
        view.grad = slot_grad
        setattr(slot.module, slot.attr, view)
