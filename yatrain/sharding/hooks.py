"""How the engine follows the model's forward and backward, unit by unit.

Before a unit's forward its weights are gathered (the next ``prefetch_depth`` units' gathers
are issued ahead) and bound to the modules as views of the gather buffer; a gate on its
output announces the start of its backward, where it is gathered again if it was evicted and
its gradient views are bound into a gradient slot; once every weight of the unit has its
gradient, the slot is reduce-scattered into the unit's fp32 gradient shard.

Ordering: the only rule is that a buffer is overwritten when its previous user is done with
it. In forward that is any unit other than the one computing; in backward, units whose
backward has finished. Units still resident from the forward (the last layers and the head)
are simply not gathered again; after the optimizer step every buffer is marked stale.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from yatrain.sharding.comm import Handle
from yatrain.sharding.layout import alias


class _BackwardGate(torch.autograd.Function):
    """Identity whose backward announces "this unit's backward starts now"."""

    @staticmethod
    def forward(ctx, callback: Callable[[], None], tensor: torch.Tensor) -> torch.Tensor:
        ctx.callback = callback
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.callback()
        return None, grad


class UnitSchedule:
    """The hooks half of ``ShardedEngine`` (a mixin: the engine owns every attribute used
    here: layouts, buffers, gradient slots, shards and the communicator)."""

    # ------------------------------------------------------------------ step state
    def _reset_step_state(self) -> None:
        self.phase = "idle"
        self.state = ["idle"] * self.n_units  # idle | forward | backward | done
        self.leaves: list[list[torch.Tensor]] = [[] for _ in range(self.n_units)]
        self.waiting_grads = [0] * self.n_units
        self.pending: list[Handle] = []
        self.micro_batches = 0
        self.small_ready = False

    def _ensure_small(self) -> None:
        if self.small_ready:
            return
        if not self.direct:
            self.comm.wait(self.comm.all_gather(self.small_buffer, self.small_compute))
        grads = alias(self.small_grad)
        for slot, view, grad in zip(
            self.small.slots,
            self.small.views(alias(self.small_buffer)),
            self.small.views(grads),
            strict=True,
        ):
            view.requires_grad_(True)
            view.grad = grad
            setattr(slot.module, slot.attr, view)
        self.small_ready = True

    # ------------------------------------------------------------------ gathering
    def _gather(self, unit: int) -> None:
        buf = self.buffer_of[unit]
        if buf.owner == unit:
            return
        buf.owner = unit
        size = self.layouts[unit].padded_numel
        buf.handle = self.comm.all_gather(buf.data[:size], self.unit_compute[unit])

    def _ensure_gathered(self, unit: int) -> torch.Tensor:
        self._gather(unit)
        buf = self.buffer_of[unit]
        self.comm.wait(buf.handle)
        return buf.alias

    def _prefetch(self, unit: int, step: int) -> None:
        """Issue the next units' gathers (forward: step=+1, backward: -1) ahead of use."""
        for k in range(1, self.prefetch_depth + 1):
            target = unit + step * k
            if not 0 <= target < self.n_units:
                return
            owner = self.buffer_of[target].owner
            busy = owner == unit if step > 0 else owner is not None and owner <= unit
            if owner != target and busy:
                return  # keep order: never skip one unit to gather a later one
            self._gather(target)

    # ------------------------------------------------------------------ hooks
    def _pre_forward(self, unit: int, module: nn.Module, args) -> None:
        if self.phase == "backward" and self.state[unit] == "backward":
            self._ensure_gathered(unit)  # activation-checkpoint recompute: bindings stay
            return
        if unit == 0:
            self.phase = "forward"
            self.state = ["idle"] * self.n_units
            if torch.is_grad_enabled():
                self.micro_batches += 1
        self._ensure_small()
        flat = self._ensure_gathered(unit)
        track = torch.is_grad_enabled()
        leaves = []
        layout = self.layouts[unit]
        for slot, view in zip(layout.slots, layout.views(flat), strict=True):
            if track:
                view.requires_grad_(True)
                view.register_post_accumulate_grad_hook(self._grad_hook(unit))
            setattr(slot.module, slot.attr, view)
            leaves.append(view)
        self.leaves[unit] = leaves if track else []
        self.state[unit] = "forward"
        self._prefetch(unit, +1)

    def _post_forward(self, unit: int, module: nn.Module, args, output):
        if self.state[unit] != "forward" or not torch.is_tensor(output):
            return None
        if not (torch.is_grad_enabled() and output.requires_grad):
            return None
        return _BackwardGate.apply(functools.partial(self._pre_backward, unit), output)

    def _pre_backward(self, unit: int) -> None:
        if self.state[unit] == "backward":
            return
        self.phase = "backward"
        self.state[unit] = "backward"
        self._ensure_gathered(unit)
        self.waiting_grads[unit] = len(self.leaves[unit])
        slot = self.slot_of[unit]
        if slot is None:  # world size 1 in fp32: accumulate straight into the grad shard
            grads = self.layouts[unit].views(alias(self.unit_grad[unit]))
        else:
            self.comm.wait(slot.handle)  # the previous reduce-scatter has left this buffer
            slot.data[: self.layouts[unit].padded_numel].zero_()
            grads = self.layouts[unit].views(slot.alias)
        for leaf, grad in zip(self.leaves[unit], grads, strict=True):
            leaf.grad = grad
        self._prefetch(unit, -1)

    def _grad_hook(self, unit: int) -> Callable[[torch.Tensor], None]:
        def hook(_: torch.Tensor) -> None:
            self.waiting_grads[unit] -= 1
            if self.waiting_grads[unit] == 0:
                self.state[unit] = "done"
                self._reduce(unit)

        return hook

    def _reduce(self, unit: int) -> None:
        slot = self.slot_of[unit]
        if slot is None:
            return
        layout, shard_grad = self.layouts[unit], self.unit_grad[unit]
        if self.direct:  # bf16 gradients, one process: accumulate into the fp32 shard
            shard_grad.add_(slot.data[: layout.numel])
            return
        full = slot.data[: layout.padded_numel]
        out = slot.out[: layout.shard_numel]
        before = after = None
        if slot.staging is not None:
            staging = slot.staging[: layout.padded_numel]
            before, after, full = functools.partial(staging.copy_, full), self._staging, staging
        handle = self.comm.reduce_scatter(
            out, full, before=before, after=after, then=functools.partial(shard_grad.add_, out)
        )
        if slot.staging is not None:
            self._staging = handle
        slot.handle = handle
        self.pending.append(handle)
