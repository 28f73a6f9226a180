"""The CUDA communicator: one communication stream, ordered against compute by events only.

Kept apart from ``comm.py`` (the interface, the CPU and single-process kinds) so that the GPU
path reads on its own: before each collective the communication stream waits for an event
recorded on the compute stream; afterwards an event is recorded that the compute stream
waits on before it touches the result. A reduction's pieces share one such pair
(``reduce_scatter_pieces``): the host work of a unit's reduction does not grow with its
piece count.

The streams and events come from ``torch.cuda``, or (``streams``) from
``fake_streams.FakeStreams``: the same path on a CPU, for a dry run.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType

import torch
import torch.distributed as dist

from yatrain.sharding.comm import (
    Communicator,
    Handle,
    ScatterPiece,
    Step,
    gather_into,
    scatter_into,
)
from yatrain.sharding.fake_streams import FakeEvent, FakeStreams


class CudaStreamCommunicator(Communicator):
    """CUDA: one communication stream, ordered against the compute stream by events only."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        device: torch.device,
        streams: FakeStreams | None = None,
    ) -> None:
        super().__init__()
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        # Looked up per call, so a test's patched ``torch.cuda`` is seen too.
        self.cuda: ModuleType | FakeStreams = torch.cuda if streams is None else streams
        self.stream = self.cuda.Stream(device=device)

    def _on_comm_stream(
        self,
        collective: Callable[[], object],
        before: Step = None,
        then: Step = None,
        after: Handle | None = None,
        kind: str = "",
    ) -> Handle:
        cuda = self.cuda
        compute_ready = cuda.Event()
        compute_ready.record(cuda.current_stream())
        self.stream.wait_event(compute_ready)
        if after is not None and after.event is not None:  # another stream's collective
            self.stream.wait_event(after.event)
        with cuda.stream(self.stream):
            if before is not None:
                before()
            collective()  # NCCL makes the current (communication) stream wait for it
            if then is not None:
                then()  # stream-ordered after the collective: no CPU sync needed
            landed = cuda.Event()
            landed.record(self.stream)
        return Handle(event=landed, kind=kind)

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, fill: Step = None) -> Handle:
        self._count(out, "all_gather")
        source, cast = self._gather_input(out, shard)
        steps = [step for step in (fill, cast) if step is not None]
        before = (lambda: [step() for step in steps]) if steps else None
        return self._on_comm_stream(
            lambda: gather_into(out, source, self.group, async_op=False),
            before,
            kind="all-gather",
        )

    def reduce_scatter(
        self, out: torch.Tensor, full: torch.Tensor, *, before: Step = None, then: Step = None
    ) -> Handle:
        self._count(full, "reduce_scatter")
        return self._on_comm_stream(
            lambda: scatter_into(out, full, self.group, async_op=False),
            before,
            then,
            kind="reduce-scatter",
        )

    def reduce_scatter_pieces(self, pieces: list[ScatterPiece]) -> Handle:
        """A reduction's pieces one after another on the communication stream, behind one
        event from the compute stream and ahead of one landed event: the host work of a
        unit's reduction does not grow with its piece count."""
        for piece in pieces:
            self._count(piece.full, "reduce_scatter")

        def in_order() -> None:
            for piece in pieces:
                if piece.before is not None:
                    piece.before()
                scatter_into(piece.out, piece.full, self.group, async_op=False)
                if piece.then is not None:
                    piece.then()

        return self._on_comm_stream(in_order, kind="reduce-scatter")

    def wait(self, handle: Handle | None) -> None:
        if handle is None or handle.done:
            return
        mark = self.clock.start(handle.kind) if self.clock is not None else None
        self.cuda.current_stream().wait_event(_event(handle))  # the stall: between the marks
        if self.clock is not None:
            self.clock.stop(mark)
        handle.done = True  # ``then`` already ran on the communication stream

    def finished(self, handle: Handle | None) -> bool:
        return handle is None or handle.done or _event(handle).query()

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        self._timed_all_reduce(tensor)  # on the compute stream: exposed by construction

    def all_reduce_max(self, tensor: torch.Tensor) -> int:
        return self._max_counted(tensor)  # on the compute stream, like the sum

    def all_reduce(self, tensor: torch.Tensor, *, after: Handle | None = None) -> Handle:
        self._count_all_reduce(tensor)
        collective = functools.partial(dist.all_reduce, tensor, group=self.group)
        return self._on_comm_stream(collective, after=after, kind="all-reduce")

    def all_to_all(
        self, out: torch.Tensor, source: torch.Tensor, out_splits: list[int], in_splits: list[int]
    ) -> Handle:
        self._count_all_to_all(source, in_splits)
        collective = functools.partial(
            dist.all_to_all_single, out, source, out_splits, in_splits, group=self.group
        )
        return self._on_comm_stream(collective, kind="all-to-all")


def _event(handle: Handle) -> torch.cuda.Event | FakeEvent:
    """A CUDA handle's landed event (every one it issues has one)."""
    if handle.event is None:
        raise RuntimeError(f"a {handle.kind or 'collective'} handle without its event")
    return handle.event
