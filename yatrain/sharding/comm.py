"""Asynchronous collectives ordered the same way on every device type.

The engine issues a gather or reduce-scatter and later waits on the returned handle right
before the data is used. How "asynchronous" and "wait" are realised is the only thing that
differs between devices, so it lives here and nowhere else:

- CPU (gloo): collectives run on gloo's own thread (``async_op=True``); waiting blocks the
  Python thread until the work is done, then runs any follow-up step (gradient accumulation).
- CUDA (NCCL): collectives run on one dedicated communication stream. Before each one the
  communication stream waits for an event recorded on the compute stream (so a buffer is
  never overwritten while a kernel still reads it); afterwards an event is recorded that the
  compute stream waits on before it touches the result. Buffers are preallocated and never
  freed, so no ``record_stream`` is needed.
- One process, no group: nothing to communicate; copies only where the buffers differ.

Every collective also counts the bytes this rank sends, so benchmarks report measured traffic.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class Handle:
    """A collective in flight. ``then`` runs once the data has landed (CPU only)."""

    work: object | None = None
    event: object | None = None
    then: Callable[[], None] | None = None
    done: bool = field(default=False)


class Communicator:
    """Single-process stand-in: same interface, no communication."""

    def __init__(self) -> None:
        self.rank, self.world_size = 0, 1
        self.bytes_sent = 0

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor) -> Handle:
        if out.data_ptr() != shard.data_ptr():
            out.copy_(shard)
        return Handle(done=True)

    def reduce_scatter(
        self,
        out: torch.Tensor,
        full: torch.Tensor,
        *,
        before: Callable[[], None] | None = None,
        after: Handle | None = None,
        then: Callable[[], None] | None = None,
    ) -> Handle:
        """Sum ``full`` across ranks into this rank's shard ``out``.

        ``before`` fills ``full`` (e.g. an fp32 staging copy) in stream order, ``after`` is a
        handle that must complete first (a shared staging buffer), ``then`` consumes ``out``.
        """
        for step in (before, lambda: out.copy_(full), then):
            if step is not None:
                step()
        return Handle(done=True)

    def wait(self, handle: Handle | None) -> None:
        if handle is None or handle.done:
            return
        self._wait(handle)
        handle.done = True
        if handle.then is not None:
            handle.then()

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        """Synchronous sum across ranks (used once per step for the gradient norm)."""

    def _wait(self, handle: Handle) -> None:
        raise NotImplementedError

    def _count(self, full: torch.Tensor) -> None:
        # Ring all-gather / reduce-scatter: each rank sends (W-1)/W of the full buffer.
        nbytes = full.numel() * full.element_size()
        self.bytes_sent += nbytes * (self.world_size - 1) // self.world_size


class GlooCommunicator(Communicator):
    """CPU: gloo's worker thread overlaps the collective with compute on this thread."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor) -> Handle:
        self._count(out)
        work = dist.all_gather_single(out, shard, group=self.group, async_op=True)
        return Handle(work=work)

    def reduce_scatter(self, out, full, *, before=None, after=None, then=None) -> Handle:
        self.wait(after)
        if before is not None:
            before()
        self._count(full)
        work = dist.reduce_scatter_single(out, full, group=self.group, async_op=True)
        return Handle(work=work, then=then)

    def _wait(self, handle: Handle) -> None:
        handle.work.wait()

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor, group=self.group)


class CudaStreamCommunicator(Communicator):
    """CUDA: one communication stream, ordered against the compute stream by events only."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device) -> None:
        super().__init__()
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.stream = torch.cuda.Stream(device=device)

    def _on_comm_stream(self, collective, before=None, then=None) -> Handle:
        compute_ready = torch.cuda.Event()
        compute_ready.record(torch.cuda.current_stream())
        self.stream.wait_event(compute_ready)
        with torch.cuda.stream(self.stream):
            if before is not None:
                before()
            collective()  # NCCL makes the current (communication) stream wait for it
            if then is not None:
                then()  # stream-ordered after the collective: no CPU sync needed
            landed = torch.cuda.Event()
            landed.record(self.stream)
        return Handle(event=landed)

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor) -> Handle:
        self._count(out)
        return self._on_comm_stream(lambda: dist.all_gather_single(out, shard, group=self.group))

    def reduce_scatter(self, out, full, *, before=None, after=None, then=None) -> Handle:
        # ``after`` needs no wait here: the communication stream runs everything in order.
        self._count(full)
        return self._on_comm_stream(
            lambda: dist.reduce_scatter_single(out, full, group=self.group), before, then
        )

    def wait(self, handle: Handle | None) -> None:
        if handle is None or handle.done:
            return
        torch.cuda.current_stream().wait_event(handle.event)
        handle.done = True  # ``then`` already ran on the communication stream

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor, group=self.group)


def make_communicator(group: dist.ProcessGroup | None, device: torch.device) -> Communicator:
    """Pick the implementation for this device; a single process needs no process group."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return Communicator()
    if device.type == "cuda":
        return CudaStreamCommunicator(group, device)
    return GlooCommunicator(group)
