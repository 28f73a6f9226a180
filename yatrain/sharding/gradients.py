"""The end of a step's gradients: the norm group's reduction, the replicas' all-reduce, and
the averaging with the clipping (a mixin of ``ShardedEngine``, which owns every attribute
used here).

Under hybrid sharding (groups.py) each shard group's reduce-scatters sum its own ranks'
gradients; one all-reduce per flat shard across replicas (rank i of every group) then
completes the sum over the world, issued back to back and waited once. After it the
replicas hold identical shards, so the gradient norm is summed over the shard group only.
"""

from __future__ import annotations

import torch


class GradientFinish:
    """``reduce_gradients`` calls ``_reduce_small`` and ``_reduce_replicas``; the loop
    calls ``clip_grad_norm_``."""

    def _reduce_small(self) -> None:
        grad = self.small_param.grad
        if self.direct:
            if self.small_grad is not grad:
                grad.copy_(self.small_grad)
            return
        full = self.small_grad.to(self.reduce_dtype)
        if self.small_out is None:  # fp32: straight into the shard
            self.comm.wait(self.comm.reduce_scatter(grad, full))
        else:
            self.comm.wait(self.comm.reduce_scatter(self.small_out, full))
            grad.copy_(self.small_out)

    def expect_micro_batches(self, count: int) -> None:
        """This step runs ``count`` micro-batches: under hybrid sharding the last one's
        reductions start the replicas' all-reduce as each lands, overlapping the rest of the
        backward. Optional: without it the all-reduce waits for ``reduce_gradients``."""
        self.expected_micro_batches = count

    def _reduce_replicas(self) -> None:
        """Sum the accumulated fp32 gradient shards across replicas (HSDP only): those the
        last backward already started, then the rest and the norm group's, waited once."""
        comm = self.replica_comm
        if comm is None:
            return
        jobs = [self.last_job[i] for i in self.owned]
        started = [job.replica_handle if job is not None else None for job in jobs]
        handles = [h for h in started if h is not None]
        for param, handle in zip(self.owned_params, started, strict=True):
            if handle is None:  # the same units on every rank: the same order of collectives
                handles.append(comm.all_reduce(param.grad))
        handles.append(comm.all_reduce(self.small_param.grad))
        for handle in handles:
            comm.wait(handle)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Average the gradients (see ``reduce_gradients``) and return their exact global L2
        norm across all shards (one all-reduce); clip to ``max_norm`` when it is > 0. One
        pass over the gradient shard scales by both factors."""
        scale = self._grad_scale if self._grad_scale is not None else 1.0
        self._grad_scale = None
        grads = [p.grad for p in self.owned_params] + [self.small_param.grad]
        # vector_norm reduces in place: no temporary the size of a gradient shard.
        norms = self._norms
        for index, grad in enumerate(grads):
            torch.linalg.vector_norm(grad, out=norms[index])
        squares = torch.dot(norms, norms)
        self.comm.all_reduce_sum(squares)  # the shard group: replicas hold the same shards
        norm = squares.sqrt() * scale
        factor = None
        if max_norm > 0:
            factor = torch.clamp(max_norm / (norm + 1e-6), max=1.0) * scale
        elif scale != 1.0:
            factor = scale
        if factor is not None:
            for g in grads:
                g.mul_(factor)
        return norm
