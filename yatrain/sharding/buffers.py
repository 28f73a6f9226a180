"""The engine's preallocated flat buffers and what each currently holds.

How many buffers of which size is decided in one place, ``sizes.engine_buffers`` (the
planner calls it too); this module allocates them and assigns units to them: gather
buffers rotate among consecutive units (the edge units either rotate with the others or
share one buffer of their own), and the units with several weight tensors take turns on
two gradient buffers. ``WorkBuffers`` is everything one engine allocated: those buffers,
the norm group's, and the reducer that owns the reduce-scatter staging (``reduce.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from yatrain.sharding.comm import Communicator, GlooCommunicator, Handle
from yatrain.sharding.cuda_comm import CudaStreamCommunicator
from yatrain.sharding.layout import alias
from yatrain.sharding.reduce import PieceReducer, ReduceJob, StreamReducer, ThreadReducer
from yatrain.sharding.shards import MasterShards
from yatrain.sharding.sizes import EngineBuffers
from yatrain.sharding.timing import IntervalClock


class Buffer:
    """A preallocated flat buffer and the unit whose data it holds (or is receiving)."""

    def __init__(self, data: torch.Tensor, owner: int | None = None, fixed: bool = False) -> None:
        self.data = data
        self.alias = alias(data)
        self.owner = owner
        self.fixed = fixed  # world size 1: the buffer *is* the unit's shard, always valid
        self.handle: Handle | None = None


class GradSlot:
    """A gradient buffer and the reduction still reading it."""

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data
        self.job: ReduceJob | None = None


def edge_and_inner(n_units: int) -> tuple[list[int], list[int]]:
    """Indices of the edge units (first and last) and of the units between them."""
    edges = sorted({0, n_units - 1})
    return edges, [i for i in range(n_units) if i not in edges]


def gather_buffers(n_units: int, plan: EngineBuffers, device: torch.device) -> list[Buffer]:
    """The gather buffer of every unit, in forward order."""
    spec = plan.gather
    ring = [Buffer(spec.empty(device)) for _ in range(spec.count)]
    if not plan.edge_owns_gather:
        return [ring[i % len(ring)] for i in range(n_units)]
    edge = Buffer(plan.edge_gather.empty(device))
    edges, inner = edge_and_inner(n_units)
    buffer_of: list[Buffer] = [edge] * n_units
    for j, i in enumerate(inner):
        buffer_of[i] = ring[j % len(ring)]
    return buffer_of


def grad_slots(
    single_tensor: list[bool], plan: EngineBuffers, device: torch.device
) -> list[GradSlot | None]:
    """The gradient buffer of every unit with several weight tensors, taken in turns."""
    spec = plan.grad
    slots = [GradSlot(spec.empty(device)) for _ in range(spec.count)]
    slot_of: list[GradSlot | None] = []
    for single in single_tensor:
        if single or not slots:
            slot_of.append(None)
        else:
            slot_of.append(slots[sum(s is not None for s in slot_of) % len(slots)])
    return slot_of


@dataclass
class WorkBuffers:
    """What one engine preallocated (exactly what its ``EngineBuffers`` plan says)."""

    buffer_of: list[Buffer]  # each unit's gather buffer (one process: its shard itself)
    slot_of: list[GradSlot | None]  # each unit's gradient buffer, if it has one
    small_buffer: torch.Tensor  # the norm group's gathered weights
    # The small group's gradient accumulates over micro-batches in the parameter dtype (in
    # place in its fp32 shard when that is what it is) and is reduced once.
    small_grad: torch.Tensor
    small_out: torch.Tensor | None  # the norm group's reduce-scatter output, if not fp32
    reducer: PieceReducer | None  # issues the gradients' reduce-scatters (None: one process)

    @classmethod
    def allocate(
        cls,
        plan: EngineBuffers,
        shards: MasterShards,
        comm: Communicator,
        *,
        direct: bool,
        device: torch.device,
        clock: IntervalClock,
    ) -> WorkBuffers:
        """Exactly what ``plan`` says; at world size 1 without a process group (``direct``)
        every unit computes straight from its shard (or its bf16 copy)."""
        dev = device
        slot_of = grad_slots([layout.single_tensor for layout in shards.layouts], plan, dev)
        reducer: PieceReducer | None = None
        if direct:
            compute, small_compute = shards.compute, shards.small_compute
            source = shards.unit_master if compute is None else shards.unit_views(compute)
            buffer_of = [Buffer(view, owner=i, fixed=True) for i, view in enumerate(source)]
            small_buffer = shards.small_master if small_compute is None else small_compute
        else:
            buffer_of = gather_buffers(len(shards.layouts), plan, dev)
            small_buffer = plan.small_gather.empty(dev)
            reducer = make_reducer(plan, comm, dev, clock)
        spec = plan.small_grad
        small_grad = spec.empty(dev).zero_() if spec.count else shards.small_grad
        small_out = plan.small_out.empty(dev) if plan.small_out.count else None
        return cls(buffer_of, slot_of, small_buffer, small_grad, small_out, reducer)

    def pump(self) -> None:
        """Let the reducer make progress (CUDA: let go of gradients already reduced)."""
        if self.reducer is not None:
            self.reducer.pump()

    def after_step(self, small_shard_grad: torch.Tensor) -> None:
        """Zero the norm group's gradients and mark every buffer stale (new masters)."""
        self.small_grad.zero_()
        if self.small_grad is not small_shard_grad:
            small_shard_grad.zero_()
        for buf in self.buffer_of:
            if not buf.fixed:
                buf.owner = None
        for slot in self.slot_of:
            if slot is not None:
                slot.job = None  # landed; it would keep the gradient shard alive


def make_reducer(
    plan: EngineBuffers, comm: Communicator, device: torch.device, clock: IntervalClock
) -> PieceReducer:
    """The reduce-scatter pieces' staging and output buffers, and who issues them."""
    staging, out = plan.staging.empty(device), plan.reduce_out.empty(device)
    if isinstance(comm, CudaStreamCommunicator):  # a unit's pieces queued as one
        return StreamReducer(comm, staging, out, plan.piece_numel)
    if not isinstance(comm, GlooCommunicator):
        raise TypeError(f"no reducer for {type(comm).__name__}: it has no process group")
    reducer = ThreadReducer(comm.second_group(), staging, out, plan.piece_numel)  # see reduce.py
    reducer.clock = clock  # the helper thread's own waits are not exposed
    return reducer
