"""Asynchronous collectives ordered the same way on every device type.

The engine issues a gather or reduce-scatter and later waits on the returned handle right
before the data is used. How "asynchronous" and "wait" are realised is the only thing that
differs between devices, so it lives here and nowhere else:

- CPU (gloo): collectives run on gloo's own thread (``async_op=True``); waiting blocks the
  Python thread until the work is done, then runs any follow-up step (gradient accumulation).
  Whether a collective has finished can be asked without blocking (``finished``).
- CUDA (NCCL, ``cuda_comm.py``): collectives run on one dedicated communication stream.
  Before each one the communication stream waits for an event recorded on the compute
  stream (so a buffer is never overwritten while a kernel still reads it); afterwards an
  event is recorded that the compute stream waits on before it touches the result. Work
  queued on the communication stream runs in order, so a buffer the next collective reuses
  (the reduce-scatter staging) is free as soon as the next one is queued. Buffers are
  preallocated and never freed, and the few tensors that are not (a gradient autograd
  allocated) are let go only once their collective has finished (``finished``): no
  ``record_stream``.
- One process, no group: nothing to communicate; copies only where the buffers differ.

Every collective also counts the bytes this rank sends, so benchmarks report measured traffic,
and how many collectives this rank has entered (``entered``, what a hang report compares);
``traffic()`` has both per kind (all-gather, reduce-scatter, all-reduce, Muon's
all-to-all), the norm's scalar sum included (which ``bytes_sent``, the planner's measure,
leaves out);
``wait`` is timed by the engine's ``clock`` (``timing.IntervalClock``): the exposed
communication of a step, on CPU the time the thread blocked, on CUDA the time the compute
stream stalled behind the event it waits on.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from yatrain.sharding.fake_streams import FakeEvent
from yatrain.sharding.timing import IntervalClock

Step = Callable[[], object] | None  # a stream-ordered step around a collective
KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")  # ``traffic()``'s keys


def host_backend() -> str:
    """The backend for a CPU process group of our own beside the default one: the default
    group's in a gloo world, and in a fake one (torch's fake process group: a gloo group
    cannot be built on its store), gloo beside NCCL or any other."""
    backend = str(dist.get_backend())
    return backend if backend in ("gloo", "fake") else "gloo"


def gather_into(
    out: torch.Tensor, source: torch.Tensor, group: dist.ProcessGroup | None, async_op: bool
) -> dist.Work | None:
    """All-gather into one flat tensor. torch 2.13 names it ``all_gather_single`` and
    deprecates ``all_gather_into_tensor``, the only name torch 2.5-2.12 has: use whichever
    this torch has (looked up per call, so a patched function is seen too)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(out, source, group=group, async_op=async_op)


def scatter_into(
    out: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup | None, async_op: bool
) -> dist.Work | None:
    """Reduce-scatter (sum) of one flat tensor: ``reduce_scatter_single`` in torch 2.13,
    ``reduce_scatter_tensor`` before it."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(out, full, group=group, async_op=async_op)


def ring_bytes(nbytes: int, world_size: int) -> int:
    """Bytes one rank sends in a ring all-gather or reduce-scatter of a ``nbytes`` buffer:
    (W-1)/W of it (an all-reduce is both: ``2 * nbytes``). The planner counts with it too."""
    return nbytes * (world_size - 1) // world_size


@dataclass(frozen=True)
class ScatterPiece:
    """One reduce-scatter of a reduction: ``before`` fills ``full`` (the staging copy),
    ``then`` consumes ``out`` (an accumulation), both in stream order."""

    out: torch.Tensor
    full: torch.Tensor
    before: Step = None
    then: Step = None


@dataclass
class Handle:
    """A collective in flight. ``then`` runs once the data has landed (CPU only)."""

    work: dist.Work | None = None  # gloo
    event: torch.cuda.Event | FakeEvent | None = None  # CUDA: recorded once it has landed
    then: Step = None
    done: bool = field(default=False)
    kind: str = ""  # "all-gather", "reduce-scatter", "all-reduce", "all-to-all" (waited on)


class Communicator:
    """Single-process stand-in: same interface, no communication."""

    def __init__(self) -> None:
        self.rank, self.world_size = 0, 1
        self.group: dist.ProcessGroup | None = None
        self.bytes_sent = 0
        self.entered = 0  # collectives issued on this communicator
        self._traffic = dict.fromkeys(KINDS, (0, 0))  # kind -> (collectives, bytes sent)
        self.clock: IntervalClock | None = None  # times ``wait`` (set by the engine)

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, fill: Step = None) -> Handle:
        """Gather every rank's ``shard`` into ``out``. A shard of another dtype than ``out``
        (an fp32 master under bf16 weights) is cast into this rank's own slice of ``out``,
        which is then gathered in place: no cast copy of the shard is kept. ``fill`` writes
        ``shard`` first, in stream order (a float8 cast into this rank's slice)."""
        if fill is not None:
            fill()
        if out.data_ptr() != shard.data_ptr():
            out.copy_(shard)
        return Handle(done=True)

    def reduce_scatter(
        self, out: torch.Tensor, full: torch.Tensor, *, before: Step = None, then: Step = None
    ) -> Handle:
        """Sum ``full`` across ranks into this rank's shard ``out``. ``before`` fills ``full``
        (e.g. a staging copy) in stream order, ``then`` consumes ``out``."""
        for step in (before, lambda: out.copy_(full), then):
            if step is not None:
                step()
        return Handle(done=True)

    def traffic(self) -> dict[str, tuple[int, int]]:
        """Collectives issued so far and the bytes this rank sent in them (ring accounting),
        per kind: ``{"all_gather": (count, bytes), "reduce_scatter": ..., "all_reduce": ...}``."""
        return dict(self._traffic)

    def wait(self, handle: Handle | None) -> None:
        if handle is None or handle.done:
            return
        mark = self.clock.start(handle.kind) if self.clock is not None else None
        self._wait(handle)
        if self.clock is not None:
            self.clock.stop(mark)
        handle.done = True
        if handle.then is not None:
            handle.then()

    def finished(self, handle: Handle | None) -> bool:
        """Has the collective completed (so memory it reads may be released)? Never blocks."""
        return handle is None or handle.done

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        """Synchronous sum across ranks (used once per step for the gradient norm)."""

    def all_reduce_max(self, tensor: torch.Tensor) -> int:
        """Synchronous maximum across ranks (float8's amaxes, once per step); returns the
        bytes this rank sent for it (they count in ``bytes_sent`` too)."""
        return 0

    def all_reduce(self, tensor: torch.Tensor, *, after: Handle | None = None) -> Handle:
        """Sum ``tensor`` across ranks in place, asynchronously (the replicas' gradients);
        on CUDA ordered after the collective ``after`` of another communicator (on CPU the
        caller issues it once that one has finished)."""
        return Handle(done=True)

    def all_to_all(
        self, out: torch.Tensor, source: torch.Tensor, out_splits: list[int], in_splits: list[int]
    ) -> Handle:
        """Send ``in_splits[r]`` consecutive elements of ``source`` to each rank r and receive
        ``out_splits[r]`` from each into ``out`` (uneven splits: Muon's whole-matrix owners)."""
        self._count_all_to_all(source, in_splits)
        out.copy_(source)
        return Handle(done=True)

    def _wait(self, handle: Handle) -> None:
        raise NotImplementedError

    def _timed_all_reduce(
        self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
    ) -> None:
        """A synchronous reduction over the group (the gradient norm's sum, float8's
        amaxes), timed as a wait. Counted in ``traffic()``; in ``bytes_sent`` by the caller."""
        self._enter("all_reduce", ring_bytes(2 * _nbytes(tensor), self.world_size))
        mark = self.clock.start("all-reduce") if self.clock is not None else None
        dist.all_reduce(tensor, op=op, group=self.group)
        if self.clock is not None:
            self.clock.stop(mark)

    def _max_counted(self, tensor: torch.Tensor) -> int:
        sent = ring_bytes(2 * _nbytes(tensor), self.world_size)
        self.bytes_sent += sent
        self._timed_all_reduce(tensor, dist.ReduceOp.MAX)
        return sent

    def _enter(self, kind: str, sent: int) -> None:
        """One more collective of ``kind`` entered, sending ``sent`` bytes."""
        self.entered += 1
        count, total = self._traffic[kind]
        self._traffic[kind] = (count + 1, total + sent)

    def _count(self, full: torch.Tensor, kind: str) -> None:
        """An all-gather into, or a reduce-scatter of, the flat tensor ``full``."""
        sent = ring_bytes(_nbytes(full), self.world_size)
        self._enter(kind, sent)
        self.bytes_sent += sent

    def _count_all_to_all(self, source: torch.Tensor, in_splits: list[int]) -> None:
        # Point to point: everything but what this rank keeps.
        sent = (sum(in_splits) - in_splits[self.rank]) * source.element_size()
        self._enter("all_to_all", sent)
        self.bytes_sent += sent

    def _count_all_reduce(self, tensor: torch.Tensor) -> None:
        # Ring all-reduce: a reduce-scatter then an all-gather, 2 (W-1)/W of the tensor.
        sent = ring_bytes(2 * _nbytes(tensor), self.world_size)
        self._enter("all_reduce", sent)
        self.bytes_sent += sent

    def _gather_input(self, out: torch.Tensor, shard: torch.Tensor) -> tuple[torch.Tensor, Step]:
        """The all-gather's input: ``shard`` itself, or (another dtype) this rank's slice of
        ``out`` and the step that casts ``shard`` into it (see ``all_gather``)."""
        if shard.dtype == out.dtype:
            return shard, None
        size = out.numel() // self.world_size
        own = out.narrow(0, self.rank * size, size)
        return own, functools.partial(own.copy_, shard)


class GlooCommunicator(Communicator):
    """CPU: gloo's worker thread overlaps the collective with compute on this thread."""

    def __init__(
        self, group: dist.ProcessGroup | None, peers: list[list[int]] | None = None
    ) -> None:
        super().__init__()
        self.group, self.peers = group, peers  # peers: every group like this one (HSDP)
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, fill: Step = None) -> Handle:
        source, cast = self._gather_input(out, shard)
        for step in (fill, cast):
            if step is not None:
                step()
        self._count(out, "all_gather")
        work = gather_into(out, source, self.group, async_op=True)
        return Handle(work=work, kind="all-gather")

    def reduce_scatter(
        self, out: torch.Tensor, full: torch.Tensor, *, before: Step = None, then: Step = None
    ) -> Handle:
        if before is not None:
            before()
        self._count(full, "reduce_scatter")
        work = scatter_into(out, full, self.group, async_op=True)
        return Handle(work=work, then=then, kind="reduce-scatter")

    def finished(self, handle: Handle | None) -> bool:
        return handle is None or handle.done or _work(handle).is_completed()

    def second_group(self) -> GlooCommunicator:
        """The same ranks on a process group of their own (collective: every rank calls
        it at the same point), so another thread can issue collectives on it. Shard groups
        (``peers``) each get theirs, created in the same order on every rank, all on the
        default group's backend (``host_backend``)."""
        backend = host_backend()
        if self.peers is not None:
            mine, _ = dist.new_subgroups_by_enumeration(self.peers, backend=backend)
            return GlooCommunicator(mine, self.peers)
        ranks = None if self.group is None else dist.get_process_group_ranks(self.group)
        return GlooCommunicator(dist.new_group(ranks, backend=backend))

    def _wait(self, handle: Handle) -> None:
        _work(handle).wait()

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        self._timed_all_reduce(tensor)

    def all_reduce_max(self, tensor: torch.Tensor) -> int:
        return self._max_counted(tensor)

    def all_reduce(self, tensor: torch.Tensor, *, after: Handle | None = None) -> Handle:
        self._count_all_reduce(tensor)
        work = dist.all_reduce(tensor, group=self.group, async_op=True)
        return Handle(work=work, kind="all-reduce")

    def all_to_all(
        self, out: torch.Tensor, source: torch.Tensor, out_splits: list[int], in_splits: list[int]
    ) -> Handle:
        self._count_all_to_all(source, in_splits)
        work = dist.all_to_all_single(
            out, source, out_splits, in_splits, group=self.group, async_op=True
        )
        return Handle(work=work, kind="all-to-all")


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _work(handle: Handle) -> dist.Work:
    """A gloo handle's work (every one it issues has one)."""
    if handle.work is None:
        raise RuntimeError(f"a {handle.kind or 'collective'} handle without its work")
    return handle.work


def merge_traffic(comms: Iterable[Communicator | None]) -> dict[str, tuple[int, int]]:
    """Several communicators' ``traffic()`` added up, kind by kind."""
    total = dict.fromkeys(KINDS, (0, 0))
    for comm in filter(None, comms):
        for kind, (count, sent) in comm.traffic().items():
            total[kind] = (total[kind][0] + count, total[kind][1] + sent)
    return total
