"""The end of a step's gradients: the outstanding reductions, the norm group's reduction,
the replicas' all-reduce, and the averaging with the clipping.

Under hybrid sharding (groups.py) each shard group's reduce-scatters sum its own ranks'
gradients; one all-reduce per flat shard across replicas (rank i of every group) then
completes the sum over the world, issued back to back and waited once. After it the
replicas hold identical shards, so the gradient norm is summed over the shard group only.
"""

from __future__ import annotations

import torch

from yatrain.sharding.buffers import WorkBuffers
from yatrain.sharding.comm import Communicator
from yatrain.sharding.shards import MasterShards
from yatrain.sharding.step_state import StepState


class GradientFinish:
    """``ShardedEngine.reduce_gradients`` and ``clip_grad_norm_``, over the engine's parts."""

    def __init__(
        self,
        step: StepState,
        shards: MasterShards,
        buffers: WorkBuffers,
        comm: Communicator,
        replica_comm: Communicator | None,
        *,
        world_size: int,
        reduce_dtype: torch.dtype,
        direct: bool,
    ) -> None:
        self.step, self.shards, self.buffers = step, shards, buffers
        self.comm, self.replica_comm = comm, replica_comm
        self.world_size, self.reduce_dtype, self.direct = world_size, reduce_dtype, direct
        # Each shard's gradient norm, then the norm group's (reused every step).
        self.norms = torch.empty(len(shards.owned) + 1, device=shards.master.device)

    def reduce_gradients(self) -> None:
        """Finish every reduction of this step; leave the averaging factor to
        ``clip_grad_norm_``."""
        step = self.step
        for index, state in enumerate(step.unit_phase):
            if state != "done" and step.leaves[index]:
                names = [s.name for s in self.shards.layouts[index].slots]
                raise RuntimeError(f"unit {index} ({names[0]}, ...) received no gradient")
        if self.buffers.reducer is not None:
            self.buffers.reducer.drain()
        for param in self.shards.unit_params:  # no backward at all this step
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        self._reduce_small()
        self._reduce_replicas()
        step.grad_scale = 1.0 / (self.world_size * max(step.micro_batches, 1))

    def _reduce_small(self) -> None:
        grad, accumulated = self.shards.small_grad, self.buffers.small_grad
        if self.direct:
            if accumulated is not grad:
                grad.copy_(accumulated)
            return
        full = accumulated.to(self.reduce_dtype)
        out = self.buffers.small_out
        if out is None:  # fp32: straight into the shard
            self.comm.wait(self.comm.reduce_scatter(grad, full))
        else:
            self.comm.wait(self.comm.reduce_scatter(out, full))
            grad.copy_(out)

    def _reduce_replicas(self) -> None:
        """Sum the accumulated fp32 gradient shards across replicas (HSDP only): those the
        last backward already started, then the rest and the norm group's, waited once."""
        comm = self.replica_comm
        if comm is None:
            return
        jobs = [self.step.last_job[i] for i in self.shards.owned]
        started = [job.replica_handle if job is not None else None for job in jobs]
        handles = [h for h in started if h is not None]
        for grad, handle in zip(self._owned_grads(), started, strict=True):
            if handle is None:  # the same units on every rank: the same order of collectives
                handles.append(comm.all_reduce(grad))
        handles.append(comm.all_reduce(self.shards.small_grad))
        for handle in handles:
            comm.wait(handle)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Average the gradients (see ``reduce_gradients``) and return their exact global L2
        norm across all shards (one all-reduce); clip to ``max_norm`` when it is > 0. One
        pass over the gradient shard scales by both factors."""
        scale = self.step.grad_scale if self.step.grad_scale is not None else 1.0
        self.step.grad_scale = None
        grads = [*self._owned_grads(), self.shards.small_grad]
        # vector_norm reduces in place: no temporary the size of a gradient shard.
        norms = self.norms
        for index, grad in enumerate(grads):
            torch.linalg.vector_norm(grad, out=norms[index])
        squares = torch.dot(norms, norms)
        self.comm.all_reduce_sum(squares)  # the shard group: replicas hold the same shards
        norm = squares.sqrt() * scale
        factor: torch.Tensor | float | None = None
        if max_norm > 0:
            factor = torch.clamp(max_norm / (norm + 1e-6), max=1.0) * scale
        elif scale != 1.0:
            factor = scale
        if factor is not None:
            for g in grads:
                g.mul_(factor)
        return norm

    def _owned_grads(self) -> list[torch.Tensor]:
        """Each owned unit's fp32 gradient shard (every one exists after the reductions)."""
        grads = [param.grad for param in self.shards.owned_params]
        if any(grad is None for grad in grads):
            raise RuntimeError("a gradient shard is missing: call reduce_gradients() first")
        return [grad for grad in grads if grad is not None]
