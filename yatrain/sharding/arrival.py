"""Where each weight's gradient goes when autograd delivers it, during the backward.

Each weight's gradient arrives as the tensor autograd made (a post-accumulate-grad hook the
forward registered on the bound weight). A unit with one weight tensor is reduce-scattered
straight from it; the weights of other units are copied into the unit's gradient buffer (no
zeroing, no adding), which is reduce-scattered once the last of them has arrived
(``reduce.py``). One process without a group has nothing to reduce: each gradient goes
straight into the fp32 gradient shard.

A tied unit (``layout.borrows``) is reduce-scattered into its home's fp32 gradient shard,
added to what is there: the home's own reduction, later in the backward, adds to it as a
later micro-batch's would, so the one shard holds the sum of both uses. Under hybrid
sharding the step's last reduction of each shard also starts its all-reduce across the
replicas (``groups.py``), overlapping the rest of the backward.
"""

from __future__ import annotations

import torch

from yatrain.sharding.buffers import WorkBuffers
from yatrain.sharding.comm import Communicator
from yatrain.sharding.reduce import ReduceJob
from yatrain.sharding.shards import MasterShards
from yatrain.sharding.step_state import StepState


class GradientArrival:
    """Takes each arriving gradient to its reduction (or, one process, its shard)."""

    def __init__(
        self,
        step: StepState,
        shards: MasterShards,
        buffers: WorkBuffers,
        replica_comm: Communicator | None,
        *,
        direct: bool,
    ) -> None:
        self.step, self.shards, self.buffers = step, shards, buffers
        self.replica_comm, self.direct = replica_comm, direct

    def arrived(self, unit: int, index: int, leaf: torch.Tensor) -> None:
        """Weight ``index`` of ``unit`` has its gradient in ``leaf.grad`` (autograd's own
        tensor): put it where it goes and drop it; the unit's last one starts its
        reduction."""
        grad, leaf.grad = leaf.grad, None
        if grad is None:
            raise RuntimeError(f"unit {unit}: a gradient hook ran without a gradient")
        layout, slot = self.shards.layouts[unit], self.buffers.slot_of[unit]
        param = layout.slots[index]
        if self.direct:  # one process: straight into the fp32 gradient shard
            home = self.shards.home[unit]
            self._direct_grad(home, param.offset, grad.reshape(-1), layout.single_tensor)
        elif slot is None:  # a single tensor: reduce-scatter autograd's tensor itself
            self._submit(unit, grad.reshape(-1), layout.numel)
        else:
            slot.data.narrow(0, param.offset, param.numel).copy_(grad.reshape(-1))
        del grad
        step = self.step
        step.waiting_grads[unit] -= 1
        if step.waiting_grads[unit] == 0:
            step.unit_phase[unit] = "done"
            if slot is not None and not self.direct:
                slot.data[layout.numel : layout.padded_numel].zero_()  # padding
                padded = slot.data[: layout.padded_numel]
                slot.job = self._submit(unit, padded, layout.padded_numel)
            step.has_grad[self.shards.home[unit]] = True
        self.buffers.pump()

    def _direct_grad(self, unit: int, offset: int, flat: torch.Tensor, single: bool) -> None:
        """One process: the gradient shard is the unit's gradient. A unit's one fp32 tensor
        becomes it as autograd made it (no copy); otherwise copy (cast) or add it in."""
        shard = self.shards.unit_params[unit]
        if single and shard.grad is None and flat.dtype == shard.dtype:
            shard.grad = flat
            return
        target = self.shards.grad_shard(unit).narrow(0, offset, flat.numel())
        if self.step.has_grad[unit]:
            target.add_(flat)
        else:
            target.copy_(flat)

    def _submit(self, unit: int, source: torch.Tensor, numel: int) -> ReduceJob:
        """Reduce-scatter ``source`` into the shard of the unit's home (itself, or the unit
        a tied unit borrows), added to what an earlier reduction put there this step."""
        reducer = self.buffers.reducer
        if reducer is None:
            raise RuntimeError("one process without a group has no reductions to submit")
        step, home = self.step, self.shards.home[unit]
        previous = step.last_job[home] if step.has_grad[home] else None
        # The step's last backward all-reduces the shard across replicas once it lands; a
        # tied shard once its home (earlier in forward, so later in backward) has added in.
        final = step.in_last_micro_batch and home == unit
        replica = self.replica_comm if final else None
        job = reducer.submit(source, numel, self.shards.grad_shard(home), previous, replica)
        step.last_job[home] = job
        return job
