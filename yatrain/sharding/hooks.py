"""How the engine follows the model's forward and backward, unit by unit.

Before a unit's forward its weights are gathered (the next ``prefetch_depth`` units' gathers
are issued ahead) and bound to the modules as views of the gather buffer; a gate on its
output announces the start of its backward, where it is gathered again if it was evicted
(unless its backward reads no weights, like an embedding's). Each weight's gradient arrives
as the tensor autograd made: a unit with one weight tensor is reduce-scattered straight
from it, the weights of other units are copied into a gradient buffer (no zeroing, no
adding), which is reduce-scattered once the last of them has arrived (``reduce.py``).

A unit tied to another (``layout.borrows``: an output head that is the embedding) is
gathered from its home's shard for each use, and its gradient is reduce-scattered into
the home's fp32 gradient shard; the home's own reduction, later in the backward, adds to
it as a later micro-batch's would, so the one shard holds the sum of both uses.

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
    here: layouts, buffers, gradient slots, shards, the communicator and the reducer)."""

    # ------------------------------------------------------------------ step state
    def _reset_step_state(self) -> None:
        self.phase = "idle"
        self.unit: int | None = None  # the unit whose forward or backward runs (progress)
        self.state = ["idle"] * self.n_units  # idle | forward | backward | done
        self.leaves: list[list[torch.Tensor]] = [[] for _ in range(self.n_units)]
        self.waiting_grads = [0] * self.n_units
        self.has_grad = [False] * self.n_units  # reduced at least once this step
        self.last_job: list = [None] * self.n_units  # its latest reduction (ReduceJob)
        self.micro_batches = 0
        self.expected_micro_batches: int | None = None  # told by expect_micro_batches
        self.small_ready = False

    def _ensure_small(self) -> None:
        if self.small_ready:
            return
        if not self.direct:
            self.comm.wait(self.comm.all_gather(self.small_buffer, self.small_master))
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
        layout, shard = self.layouts[unit], self.unit_master[unit]
        sent = self.comm.bytes_sent
        if self.gathers_fp8(unit):
            full = buf.data.view(torch.uint8)[: layout.padded_numel]
            own = full.narrow(0, self.rank * layout.shard_numel, layout.shard_numel)
            if not self.float8.fresh:
                self.float8.refresh(self.unit_master, self.comm.all_reduce_max)
            cast = functools.partial(self.float8.cast, unit, shard, own)
            buf.handle = self.comm.all_gather(full, own, fill=cast)
        else:
            full = buf.data[: layout.padded_numel]
            buf.handle = self.comm.all_gather(full, shard)  # casts in place (bf16)
        self.gathered_bytes[unit] += self.comm.bytes_sent - sent

    def _ensure_gathered(self, unit: int) -> torch.Tensor:
        self._gather(unit)
        buf = self.buffer_of[unit]
        self.comm.wait(buf.handle)
        return buf.alias

    def _prefetch(self, unit: int, step: int) -> None:
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
            self._gather(target)
            issued += 1

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
        self.unit = unit
        self._pump()
        self._ensure_small()
        flat = self._ensure_gathered(unit)
        track = torch.is_grad_enabled()
        leaves = []
        layout = self.layouts[unit]
        if self.gathers_fp8(unit):
            views = self.float8.weights(unit, layout, flat.view(torch.uint8), self.param_dtype)
        else:
            views = layout.views(flat)
        for index, (slot, view) in enumerate(zip(layout.slots, views, strict=True)):
            if track:
                view.requires_grad_(True)
                view.register_post_accumulate_grad_hook(
                    functools.partial(self._grad_arrived, unit, index)
                )
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
        self.unit = unit
        self.state[unit] = "backward"
        if self.reads_weights[unit]:
            self._ensure_gathered(unit)
        self.waiting_grads[unit] = len(self.leaves[unit])
        slot = self.slot_of[unit]
        if slot is not None:  # the previous unit in this buffer must have left it
            self.reducer.release(slot.job)
        self._prefetch(unit, -1)

    def _grad_arrived(self, unit: int, index: int, leaf: torch.Tensor) -> None:
        """One weight's gradient is in ``leaf.grad`` (autograd's own tensor): put it where
        it goes and drop it; the unit's last one starts its reduction."""
        grad, leaf.grad = leaf.grad, None
        layout, slot = self.layouts[unit], self.slot_of[unit]
        param = layout.slots[index]
        if self.direct:  # one process: straight into the fp32 gradient shard
            self._direct_grad(self.home[unit], param.offset, grad.reshape(-1), layout.single_tensor)
        elif slot is None:  # a single tensor: reduce-scatter autograd's tensor itself
            self._submit(unit, grad.reshape(-1), layout.numel)
        else:
            slot.data.narrow(0, param.offset, param.numel).copy_(grad.reshape(-1))
        del grad
        self.waiting_grads[unit] -= 1
        if self.waiting_grads[unit] == 0:
            self.state[unit] = "done"
            if slot is not None and not self.direct:
                slot.data[layout.numel : layout.padded_numel].zero_()  # padding
                slot.job = self._submit(unit, slot.data[: layout.padded_numel], layout.padded_numel)
            self.has_grad[self.home[unit]] = True
        self._pump()

    def _direct_grad(self, unit: int, offset: int, flat: torch.Tensor, single: bool) -> None:
        """One process: the gradient shard is the unit's gradient. A unit's one fp32 tensor
        becomes it as autograd made it (no copy); otherwise copy (cast) or add it in."""
        shard = self.unit_params[unit]
        if single and shard.grad is None and flat.dtype == shard.dtype:
            shard.grad = flat
            return
        target = self._grad_shard(unit).narrow(0, offset, flat.numel())
        target.add_(flat) if self.has_grad[unit] else target.copy_(flat)

    def _submit(self, unit: int, source: torch.Tensor, numel: int):
        """Reduce-scatter ``source`` into the shard of the unit's home (itself, or the unit
        a tied unit borrows), added to what an earlier reduction put there this step."""
        home = self.home[unit]
        previous = self.last_job[home] if self.has_grad[home] else None
        # The step's last backward all-reduces the shard across replicas once it lands; a
        # tied shard once its home (earlier in forward, so later in backward) has added in.
        final = self.micro_batches == self.expected_micro_batches and home == unit
        replica = self.replica_comm if final else None
        job = self.reducer.submit(source, numel, self._grad_shard(home), previous, replica)
        self.last_job[home] = job
        return job

    def _pump(self) -> None:
        if self.reducer is not None:
            self.reducer.pump()
