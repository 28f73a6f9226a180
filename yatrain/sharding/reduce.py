"""Gradient reduce-scatter through one staging buffer, into the fp32 shard: one collective per
unit and micro-batch wherever the unit fits the staging budget (``sizes.py``).

A unit's full gradient (``W x S`` elements at world size W, shard length S) is viewed as W
rows of S. Piece c is the columns ``[c*s, (c+1)*s)`` of every row: copied (and cast to the
reduce dtype) into the staging buffer, which is then exactly the input a reduce-scatter
wants, and its result is this rank's shard elements ``[c*s, (c+1)*s)``. A unit that fits the
budget is one piece: the whole gradient, cast by one copy. On a step's first micro-batch the
result is written straight into the fp32 gradient shard; on later ones it goes to a
piece-sized output buffer and is added. When no cast is needed and nothing is accumulated,
the whole unit is reduce-scattered straight from its gradient into its shard.

Pieces go out one after another, each reusing the staging buffer once the previous one is
done with it:

- CUDA (``StreamReducer``): a unit's pieces are queued together on the communication stream,
  which runs them in order (so the staging buffer is free for the next piece by
  construction), behind one event from the compute stream and ahead of one event back: the
  host work of a unit's reduction is a constant number of events and stream waits, whatever
  its piece count. Finished reductions are let go in order, from the front of the queue.
- gloo (``ThreadReducer``): a collective must finish before its staging buffer is refilled,
  which would stall the backward pass if the training thread waited for it. A helper thread
  issues the pieces instead, one after another, on a process group of its own (so the order
  of collectives on each group is the same on every rank). The training thread only waits
  when it needs a gradient buffer back or the step's gradients (``release``, ``drain``).
"""

from __future__ import annotations

import functools
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from yatrain.sharding.comm import Communicator, Handle, ScatterPiece
from yatrain.sharding.cuda_comm import CudaStreamCommunicator
from yatrain.sharding.sizes import equal_pieces
from yatrain.sharding.timing import IntervalClock


@dataclass
class ReduceJob:
    """One gradient on its way into a shard. ``source`` stays referenced until every piece
    has read it; ``handles`` are its collectives."""

    source: torch.Tensor | None  # numel <= W x S elements: autograd's own gradient tensor
    numel: int  # may be shorter than the padded length; the missing tail counts as zero
    shard: torch.Tensor  # this rank's fp32 shard of the unit, S elements
    accumulate: bool
    pieces: int
    width: int  # columns of every piece but perhaps the last
    direct: bool = False  # one reduce-scatter reading the source itself
    issued: int = 0
    landed: bool = False  # every collective finished and its result is in the shard
    handles: list[Handle] = field(default_factory=list)
    # Hybrid sharding, the step's last reduction of the unit: once it has landed the shard is
    # all-reduced across replicas on ``replica`` (``replica_handle``), overlapping the backward.
    replica: Communicator | None = None
    replica_handle: Handle | None = None

    @property
    def fully_issued(self) -> bool:
        return self.issued == self.pieces


class PieceReducer:
    """The pieces of every job, issued in submission order (see the module docstring).
    ``piece``: the staging buffer's width per rank, the widest piece of any unit."""

    def __init__(
        self, comm: Communicator, staging: torch.Tensor, out: torch.Tensor, piece: int
    ) -> None:
        self.comm, self.staging, self.out, self.piece = comm, staging, out, piece
        self.world = comm.world_size
        self.clock: IntervalClock | None = None  # times the training thread's waits (gloo)

    def new_job(
        self,
        source: torch.Tensor,
        numel: int,
        shard: torch.Tensor,
        previous: ReduceJob | None,
        replica: Communicator | None = None,
    ) -> ReduceJob:
        """``source`` (a unit's full gradient, ``numel`` real elements) into ``shard``,
        added to ``previous`` (the unit's reduction of an earlier micro-batch, if any), then
        all-reduced on ``replica`` when given."""
        accumulate = previous is not None
        shard_len = shard.numel()
        if not accumulate and numel == shard_len * self.world and source.dtype == shard.dtype:
            return ReduceJob(
                source, numel, shard, accumulate, 1, shard_len, direct=True, replica=replica
            )
        pieces, width = equal_pieces(shard_len, self.piece)  # as sizes.engine_buffers planned
        return ReduceJob(source, numel, shard, accumulate, pieces, width, replica=replica)

    def piece_of(self, job: ReduceJob, index: int) -> ScatterPiece:
        """Piece ``index`` of ``job``, to be issued once the previous one is done with the
        staging (what fills the staging runs in stream order, right before the collective);
        the caller counts it in ``job.issued`` once it is issued."""
        source = job.source
        if source is None:
            raise RuntimeError("a reduction's piece issued after its source was let go")
        if job.direct:
            return ScatterPiece(job.shard, source[: job.numel])
        column = index * job.width
        width = min(job.width, job.shard.numel() - column)
        staging = self.staging[: self.world * width]
        target = job.shard.narrow(0, column, width)
        before = functools.partial(
            _stage_piece, source, job.numel, job.shard.numel(), staging, column, width
        )
        if job.accumulate or self.out.dtype != target.dtype:
            out = self.out[:width]
            then = functools.partial(target.add_ if job.accumulate else target.copy_, out)
            return ScatterPiece(out, staging, before, then)
        return ScatterPiece(target, staging, before)  # the first micro-batch: into the shard

    def submit(
        self,
        source: torch.Tensor,
        numel: int,
        shard: torch.Tensor,
        previous: ReduceJob | None,
        replica: Communicator | None = None,
    ) -> ReduceJob:
        """Start reducing ``source`` into ``shard`` (see ``new_job``)."""
        raise NotImplementedError

    def pump(self) -> None:
        """Make progress without blocking (called from the hooks)."""
        raise NotImplementedError

    def release(self, job: ReduceJob | None) -> None:
        """Wait until ``job`` no longer reads its source (its gradient buffer is free)."""
        raise NotImplementedError

    def drain(self) -> None:
        """Wait until every submitted job has landed in its shard."""
        raise NotImplementedError


class StreamReducer(PieceReducer):
    """CUDA: a job's pieces are queued together as soon as it is submitted."""

    def __init__(
        self, comm: CudaStreamCommunicator, staging: torch.Tensor, out: torch.Tensor, piece: int
    ) -> None:
        super().__init__(comm, staging, out, piece)
        self.stream_comm = comm
        self.pending: deque[ReduceJob] = deque()  # submitted, source not yet let go

    def submit(
        self,
        source: torch.Tensor,
        numel: int,
        shard: torch.Tensor,
        previous: ReduceJob | None,
        replica: Communicator | None = None,
    ) -> ReduceJob:
        job = self.new_job(source, numel, shard, previous, replica)
        pieces = [self.piece_of(job, index) for index in range(job.pieces)]
        handle = self.stream_comm.reduce_scatter_pieces(pieces)  # two events, two waits
        job.issued = job.pieces
        job.handles.append(handle)
        if replica is not None:  # ordered after the pieces by their event
            job.replica_handle = replica.all_reduce(job.shard, after=handle)
        self.pending.append(job)
        self.pump()
        return job

    def pump(self) -> None:
        """Let go of the sources (autograd's gradients) of the jobs at the front of the queue
        that have finished: the stream runs them in order, so the first unfinished one ends
        the look (one event query per call in the steady state)."""
        pending = self.pending
        while pending and all(self.comm.finished(h) for h in pending[0].handles):
            job = pending.popleft()
            job.source, job.landed = None, True

    def release(self, job: ReduceJob | None) -> None:
        """Make the compute stream wait until ``job`` no longer reads its source."""
        if job is not None and job.source is not None:
            for handle in job.handles:
                self.comm.wait(handle)
            job.source = None

    def drain(self) -> None:
        for job in self.pending:
            self.release(job)
            job.landed = True
        self.pending.clear()


class ThreadReducer(PieceReducer):
    """gloo: a helper thread issues the pieces in order and waits for each (see above)."""

    def __init__(
        self, comm: Communicator, staging: torch.Tensor, out: torch.Tensor, piece: int
    ) -> None:
        super().__init__(comm, staging, out, piece)
        self.queue: deque[ReduceJob] = deque()
        self.cond = threading.Condition()
        self.busy = False  # the helper holds a job it has not finished
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None

    def submit(
        self,
        source: torch.Tensor,
        numel: int,
        shard: torch.Tensor,
        previous: ReduceJob | None,
        replica: Communicator | None = None,
    ) -> ReduceJob:
        if previous is not None:  # gloo may finish collectives out of order: ours adds
            self._wait_for(lambda: previous.landed)
        job = self.new_job(source, numel, shard, previous, replica)
        with self.cond:
            if self.thread is None:  # started in the process that uses it (ranks fork)
                self.thread = threading.Thread(target=self._run, daemon=True)
                self.thread.start()
            self.queue.append(job)
            self.cond.notify_all()
        return job

    def pump(self) -> None:
        """Nothing to do: the helper thread makes progress by itself."""

    def release(self, job: ReduceJob | None) -> None:
        """Block until ``job`` no longer reads its source (its gradient buffer is free)."""
        if job is not None:
            # Pieces are copied into the staging buffer before they are issued; a direct
            # reduce-scatter reads its source until it lands.
            self._wait_for(lambda: job.landed if job.direct else job.fully_issued)

    def drain(self) -> None:
        """Block until every submitted job has landed in its shard."""
        self._wait_for(lambda: not self.queue and not self.busy)

    def _wait_for(self, ready: Callable[[], bool]) -> None:
        clock = self.clock
        mark = clock.start("reduce-scatter") if clock is not None else None
        with self.cond:
            self.cond.wait_for(lambda: ready() or self.error is not None)
            if self.error is not None:  # as raised in the helper thread (e.g. a lost peer)
                raise self.error  # still "waiting" for a hang report, as a failed wait is
            if clock is not None:
                clock.stop(mark)

    def _run(self) -> None:
        try:
            while True:
                with self.cond:
                    self.cond.wait_for(lambda: self.queue)
                    job = self.queue[0]
                    self.busy = True
                while not job.fully_issued:
                    piece = self.piece_of(job, job.issued)
                    handle = self.comm.reduce_scatter(
                        piece.out, piece.full, before=piece.before, then=piece.then
                    )  # the copy into staging is done here
                    job.handles.append(handle)
                    with self.cond:
                        job.issued += 1
                        self.cond.notify_all()
                    self.comm.wait(handle)  # the staging and out buffers are free again
                job.source = None
                if job.replica is not None:  # the replicas' group is this thread's alone
                    job.replica_handle = job.replica.all_reduce(job.shard)
                with self.cond:
                    job.landed = True
                    self.queue.popleft()
                    self.busy = False
                    self.cond.notify_all()
                del job, handle, piece  # idle: hold no gradient (nor its shard) until the next job
        except BaseException as error:  # surfaced to the training thread
            with self.cond:
                self.error = error
                self.cond.notify_all()


def _stage_piece(
    source: torch.Tensor,
    numel: int,
    shard_len: int,
    staging: torch.Tensor,
    column: int,
    width: int,
) -> None:
    """Copy (and cast) columns ``[column, column + width)`` of ``source`` seen as W rows of
    ``shard_len`` into ``staging`` (W x width); elements at or past ``numel`` are zero."""
    if width == shard_len:  # the whole unit in one piece: one cast copy (and the padding)
        staging[:numel].copy_(source[:numel])
        if numel < staging.numel():
            staging[numel:].zero_()
        return
    world = staging.numel() // width
    rows = staging.view(world, width)
    full = min(world, numel // shard_len)  # rows that exist entirely in the source
    if full:
        rows[:full].copy_(source[: full * shard_len].view(full, shard_len)[:, column:][:, :width])
    if full < world:
        start = full * shard_len + column
        present = max(0, min(width, numel - start))
        if present:
            rows[full, :present].copy_(source[start : start + present])
        rows[full, present:].zero_()
        rows[full + 1 :].zero_()
