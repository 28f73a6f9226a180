"""Context parallelism's collectives: one sequence cut into 2 x CP chunks across CP ranks.

Llama 3's method (the Llama 3 paper, section 3.3.2): a window of T tokens is cut into
2 x CP chunks of T / (2 CP) tokens and rank i of a CP group holds chunks i and 2 CP - 1 - i,
so every rank's causal attention does the same work (an early chunk sees few keys, its
partner many). Each rank computes the queries, keys and values of its own tokens; the keys
and values of the whole window are all-gathered across the group (one collective per layer
per micro-batch: keys and values travel together) and the gradients that reach them in the
backward are reduce-scattered back to the ranks that computed them (``gather``, an autograd
function). The collectives go through a ``comm.Communicator`` on the CP group: counted in
its ``bytes_sent``, on CUDA on its communication stream.

This module knows tensors and positions in a window, not models: how the gathered keys and
values are attended is the caller's (``context_parallel.split``).

CP groups are contiguous ranks (``[0..CP-1], [CP..2CP-1], ...``), as in torchtitan's mesh,
so a group sits inside one shard group (hybrid sharding) and, with ``auto``, inside one node.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from yatrain.sharding.comm import Communicator
from yatrain.sharding.groups import make_communicator

# The budget of the one additive causal mask a CPU rank's CP attention shares between its
# query pieces (``context_parallel.attention``): 8 MiB in fp32, whatever the window (the
# planner counts it)
MASK_ELEMENTS = 2**21


class ContextGroup:
    """The ranks that share one sequence: which chunks this rank holds, and the collectives
    that move keys and values between them (see the module docstring)."""

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self.rank, self.size = comm.rank, comm.world_size

    @classmethod
    def build(cls, size: int, device: torch.device | str, cuda_path: bool = False) -> ContextGroup:
        """Contiguous groups of ``size`` ranks over the whole world; this rank's. Collective:
        every rank calls it at the same point. ``cuda_path``: ``groups.make_communicator``'s."""
        world = dist.get_world_size()
        if size < 2 or world % size:
            raise ValueError(f"a context-parallel group of {size} ranks in a world of {world}")
        layout = [list(range(start, start + size)) for start in range(0, world, size)]
        group, _ = dist.new_subgroups_by_enumeration(layout)
        device = torch.device(device)
        return cls(make_communicator(group, device, force_group=True, cuda_path=cuda_path))

    @property
    def chunks(self) -> tuple[int, int]:
        """The two chunks of a window this rank holds, in window order."""
        return self.rank, 2 * self.size - 1 - self.rank

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank sent in the K/V all-gathers and their gradients' reduce-scatters."""
        return self.comm.bytes_sent

    def split(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's two chunks of ``tensor`` (a whole window along ``dim``), concatenated."""
        pieces = tensor.chunk(2 * self.size, dim)
        first, second = self.chunks
        return torch.cat([pieces[first], pieces[second]], dim)

    def positions(self, seq_len: int, device: torch.device | str) -> torch.Tensor:
        """[2 T / (2 CP)] the window positions of this rank's tokens."""
        return self.split(torch.arange(seq_len, device=device), 0)

    def gather(self, local: torch.Tensor, dim: int) -> torch.Tensor:
        """The whole window, in window order, from every rank's ``split`` of it along ``dim``
        (collective); its gradient is reduce-scattered back in the backward."""
        dim = dim % local.dim()
        parts = _GatherSequence.apply(local, self)  # [CP, *local.shape], rank order
        parts = parts.unflatten(dim + 1, (2, local.shape[dim] // 2))
        # rank r holds chunks r and 2 CP - 1 - r: the second halves, reversed, end the window
        ordered = torch.cat([parts.select(dim + 1, 0), parts.select(dim + 1, 1).flip(0)])
        return ordered.movedim(0, dim).flatten(dim, dim + 1)

    def all_gather(self, local: torch.Tensor) -> torch.Tensor:
        """[CP, *local.shape]: every rank's ``local``, in rank order."""
        local = local.contiguous()
        out = torch.empty((self.size, *local.shape), dtype=local.dtype, device=local.device)
        self.comm.wait(self.comm.all_gather(out.view(-1), local.view(-1)))
        return out

    def reduce_scatter(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slot of ``full`` [CP, ...], summed over the group."""
        full = full.contiguous()
        out = torch.empty(full.shape[1:], dtype=full.dtype, device=full.device)
        self.comm.wait(self.comm.reduce_scatter(out.view(-1), full.view(-1)))
        return out


class _GatherSequence(torch.autograd.Function):
    """All-gather forward, reduce-scatter (sum) backward: every rank's copy of the gathered
    tensor feeds its own attention, so the gradient of one rank's slice is the sum of what
    every rank's attention sends back to it."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: ContextGroup) -> torch.Tensor:
        ctx.group = group
        return group.all_gather(local)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.group.reduce_scatter(grad), None
