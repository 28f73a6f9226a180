"""How the engine follows the model's forward and backward, unit by unit.

Before a unit's forward its weights are gathered (the next ``prefetch_depth`` units' gathers
are issued ahead, ``gathers.py``) and bound to the modules as views of the gather buffer; a
gate on its output announces the start of its backward, where it is gathered again if it was
evicted (unless its backward reads no weights, like an embedding's). The gradients that the
backward delivers are routed by ``arrival.py``. Where the step stands lives in ``StepState``
(``step_state.py``).

A unit tied to another (``layout.borrows``: an output head that is the embedding) is
gathered from its home's shard for each use.

Ordering: the only rule is that a buffer is overwritten when its previous user is done with
it. In forward that is any unit other than the one computing; in backward, units whose
backward has finished. Units still resident from the forward (the last layers and the head)
are simply not gathered again; after the optimizer step every buffer is marked stale.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from yatrain.sharding.arrival import GradientArrival
from yatrain.sharding.buffers import WorkBuffers
from yatrain.sharding.comm import Communicator
from yatrain.sharding.gathers import UnitGathers, bind_small_group
from yatrain.sharding.layout import FlatLayout
from yatrain.sharding.shards import MasterShards
from yatrain.sharding.step_state import StepState


class _BackwardGate(torch.autograd.Function):
    """Identity whose backward announces "this unit's backward starts now"."""

    @staticmethod
    def forward(ctx: Any, callback: Callable[[], None], tensor: torch.Tensor) -> torch.Tensor:
        ctx.callback = callback
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        ctx.callback()
        return None, grad


class UnitHooks:
    """The forward pre-/post-hooks of every unit and the start of each unit's backward."""

    def __init__(
        self,
        step: StepState,
        gathers: UnitGathers,
        arrival: GradientArrival,
        buffers: WorkBuffers,
        shards: MasterShards,
        comm: Communicator,
        small: FlatLayout,
        *,
        param_dtype: torch.dtype,
        direct: bool,
    ) -> None:
        self.step, self.gathers, self.arrival, self.buffers = step, gathers, arrival, buffers
        self.shards, self.comm, self.small = shards, comm, small
        self.param_dtype, self.direct = param_dtype, direct

    def register(self, units: Sequence[nn.Module]) -> None:
        """Hook every unit (``units`` in forward order, as laid out)."""
        for index, unit in enumerate(units):
            unit.register_forward_pre_hook(functools.partial(self.pre_forward, index))
            unit.register_forward_hook(functools.partial(self.post_forward, index))

    def pre_forward(self, unit: int, module: nn.Module, args: tuple[Any, ...]) -> None:
        """Gather ``unit`` (prefetching the next ones) and bind its weights to the modules;
        under autograd they get hooks that route their gradients (``arrival.py``)."""
        step = self.step
        if step.phase == "backward" and step.unit_phase[unit] == "backward":
            self.gathers.ensure_gathered(unit)  # activation-checkpoint recompute: bindings stay
            return
        if unit == 0:
            step.begin_micro_batch(with_backward=torch.is_grad_enabled())
        step.unit = unit
        self.buffers.pump()
        self._ensure_small()
        flat = self.gathers.ensure_gathered(unit)
        track = torch.is_grad_enabled()
        leaves = []
        layout = self.shards.layouts[unit]
        views = self.gathers.weights(unit, flat, self.param_dtype)
        for index, (slot, view) in enumerate(zip(layout.slots, views, strict=True)):
            if track:
                view.requires_grad_(True)
                view.register_post_accumulate_grad_hook(
                    functools.partial(self.arrival.arrived, unit, index)
                )
            setattr(slot.module, slot.attr, view)
            leaves.append(view)
        step.leaves[unit] = leaves if track else []
        step.unit_phase[unit] = "forward"
        self.gathers.prefetch(unit, +1)

    def post_forward(self, unit: int, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        """Put a gate on ``unit``'s output whose backward starts the unit's backward."""
        if self.step.unit_phase[unit] != "forward" or not torch.is_tensor(output):
            return None
        if not (torch.is_grad_enabled() and output.requires_grad):
            return None
        return _BackwardGate.apply(functools.partial(self.pre_backward, unit), output)

    def pre_backward(self, unit: int) -> None:
        """``unit``'s backward starts: its weights again (if it reads them), its gradient
        buffer back from the previous unit's reduction, the next gathers ahead."""
        step = self.step
        if step.unit_phase[unit] == "backward":
            return
        step.phase = "backward"
        step.unit = unit
        step.unit_phase[unit] = "backward"
        if self.gathers.reads_weights[unit]:
            self.gathers.ensure_gathered(unit)
        step.waiting_grads[unit] = len(step.leaves[unit])
        slot, reducer = self.buffers.slot_of[unit], self.buffers.reducer
        if slot is not None and reducer is not None:  # its previous unit must have left it
            reducer.release(slot.job)
        self.gathers.prefetch(unit, -1)

    def _ensure_small(self) -> None:
        """The norm group, gathered and bound once per step."""
        if self.step.small_ready:
            return
        buffers = self.buffers
        bind_small_group(
            self.comm,
            self.small,
            buffers.small_buffer,
            self.shards.small_master,
            buffers.small_grad,
            direct=self.direct,
        )
        self.step.small_ready = True
