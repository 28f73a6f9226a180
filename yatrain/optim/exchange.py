"""Whole matrices for Muon: one owner rank per matrix, reached by all-to-alls bucket by bucket,
the exchange of one bucket overlapped with the owners' Newton-Schulz of the one before.

``exchange_plan`` says who owns which matrix and which pieces go where, bucket by bucket. A
step runs the buckets as a pipeline. For bucket b, each rank sends its pieces to the owners
(one all-to-all with uneven splits, padding excluded), the owners assemble and orthogonalise
their matrices in the receive buffer and send each piece back into the send buffer where it
came from (a second one, the splits swapped). Bucket b+1's pieces go out before bucket b's
Newton-Schulz starts, and bucket b's results before anything later is waited on; bucket b-1
has landed (its buffers let go) before b+1 goes out: at most two buckets' buffers are live
(``exchange_memory`` counts them). The all-to-alls are the communicator's: async work on
gloo, on the communication stream behind and ahead of events on CUDA (``cuda_comm``), so
Newton-Schulz on the compute stream runs while the next bucket travels. Every buffer is held
until its collective has been waited on: no ``record_stream``.

Under hybrid sharding the replicas hold the same shards once their gradients are all-reduced,
so one owner per matrix in the whole world suffices (``optim.muon_hsdp: split``, given the
replicas' communicator): each replica's group exchanges only the matrices its ranks own, and
a third all-to-all per bucket across the replicas (rank i of each) hands every replica the
results the others computed for its pieces. Without it (``repeat``) every replica
orthogonalises every matrix itself: no traffic across replicas, the Newton-Schulz work
repeated once per replica.

The waits are timed as exposed communication, the Newton-Schulz as compute
(``exchange_timing``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from yatrain.optim.exchange_plan import (
    Bucket,
    ExchangePlan,
    Received,
    Sent,
    assign_owners,
    ns_cost,
)
from yatrain.optim.exchange_timing import exchange_times
from yatrain.optim.newton_schulz import zeropower
from yatrain.sharding.comm import Communicator, Handle
from yatrain.sharding.layout import MatrixMap

__all__ = ["Land", "MatrixExchange", "Received", "Sent", "assign_owners", "ns_cost"]

# What a caller does with a bucket's results: this rank's pieces of its matrices (``Sent.at``
# into the results, in the exchange's dtype), before the buffer is let go.
Land = Callable[[Sequence[Sent], torch.Tensor], None]


@dataclass
class Flight:
    """A bucket on its way: ``source`` (this replica's block: the pieces out, then their
    results back), ``owned`` (the owned matrices' pieces, orthogonalised in place) and the
    all-to-all between them now running; emptied once the bucket has landed."""

    bucket: Bucket
    source: torch.Tensor | None
    owned: torch.Tensor | None
    handle: Handle | None


class MatrixExchange(ExchangePlan):
    """The plan (``ExchangePlan``) of this rank of ``comm``'s group, run on it.

    ``replicas``: the replicas' communicator (rank i of every shard group) to split the
    owners over the whole world; None orthogonalises every matrix in each group.
    ``bucket_numel``: the matrix elements of a bucket (``exchange_plan.bucket_numel``);
    None: one bucket, every matrix at once."""

    def __init__(
        self,
        maps: Sequence[MatrixMap],
        comm: Communicator,
        replicas: Communicator | None = None,
        bucket_numel: int | None = None,
    ) -> None:
        replica, copies = (replicas.rank, replicas.world_size) if replicas else (0, 1)
        super().__init__(maps, comm.rank, comm.world_size, replica, copies, bucket_numel)
        self.comm, self.replicas = comm, replicas
        self.times = exchange_times(comm.clock)  # the step clock's, beside the engine's waits

    def orthogonalize(
        self, updates: Sequence[torch.Tensor], steps: int, dtype: torch.dtype, land: Land
    ) -> None:
        """Every matrix of ``updates`` (each unit's flat shard) orthogonalised in ``dtype``
        by its owner, bucket by bucket (module docstring); ``land`` gets each bucket's
        results for this rank's pieces as they arrive, in bucket order."""
        posted = [self._post(bucket, updates, dtype) for bucket in self.buckets[:1]]
        for b in range(len(self.buckets)):
            if b > 0:
                self._land(posted[b - 1], land)  # before b + 1 goes out: two buckets at most
            if b + 1 < len(self.buckets):
                posted.append(self._post(self.buckets[b + 1], updates, dtype))
            self._turn(posted[b], steps, dtype)
        if posted:
            self._land(posted[-1], land)

    def _post(self, bucket: Bucket, updates: Sequence[torch.Tensor], dtype: torch.dtype) -> Flight:
        """Copy this rank's pieces of the bucket's matrices its replica owns into a send
        buffer, owner by owner, and send them."""
        source = torch.empty(sum(bucket.in_splits), dtype=dtype, device=updates[0].device)
        for piece in bucket.sent:
            if self.replica[piece.matrix] == self.me:
                at = source.narrow(0, piece.at - bucket.base, piece.length)
                at.copy_(updates[piece.unit].narrow(0, piece.in_shard, piece.length))
        owned = torch.empty(sum(bucket.out_splits), dtype=dtype, device=source.device)
        handle = self.comm.all_to_all(owned, source, bucket.out_splits, bucket.in_splits)
        return Flight(bucket, source, owned, handle)

    def _turn(self, flight: Flight, steps: int, dtype: torch.dtype) -> None:
        """Once its pieces are in, orthogonalise the bucket's owned matrices in place and
        send each piece back where it came from."""
        source, owned, bucket = flight.source, flight.owned, flight.bucket
        assert source is not None and owned is not None
        self._wait(self.comm, flight.handle)
        mark = self.times.compute.start()
        for k, pieces in bucket.received.items():
            self._orthogonalise(k, pieces, owned, steps, dtype)
        self.times.compute.stop(mark)
        flight.handle = self.comm.all_to_all(source, owned, bucket.in_splits, bucket.out_splits)

    def _orthogonalise(
        self, k: int, pieces: list[Received], owned: torch.Tensor, steps: int, dtype: torch.dtype
    ) -> None:
        """Matrix ``k`` assembled from its ``pieces`` in ``owned``, orthogonalised, and its
        pieces written back over them (workspace: ``newton_schulz.workspace``)."""
        matrix = torch.empty(self.shapes[k], dtype=dtype, device=owned.device)
        flat = matrix.view(-1)
        for p in pieces:
            flat.narrow(0, p.in_matrix, p.length).copy_(owned.narrow(0, p.at, p.length))
        result = zeropower(matrix, steps, dtype, scratch=True).view(-1)
        for p in pieces:
            owned.narrow(0, p.at, p.length).copy_(result.narrow(0, p.in_matrix, p.length))

    def _land(self, flight: Flight, land: Land) -> None:
        """Wait for a bucket's results (and the other replicas'), hand them to ``land`` and
        let the bucket's buffers go."""
        self._wait(self.comm, flight.handle)
        flight.handle = flight.owned = None  # the return's input: done with
        results = self._share(flight) if self.replicas is not None else flight.source
        flight.source = None
        assert results is not None
        land(flight.bucket.sent, results)

    def _share(self, flight: Flight) -> torch.Tensor:
        """Every replica's results for this rank's pieces of the bucket, given this
        replica's (``flight.source``, let go here): each owner's result reaches the matching
        rank of every replica, its own by the group's all-to-all, the others by one across
        the replicas (rank i of each)."""
        assert self.replicas is not None and flight.source is not None
        back, flight.source = flight.source, None
        same = [back.numel()] * len(self.blocks)  # the same block to every replica
        send = back.repeat(len(self.blocks))
        del back
        blocks = flight.bucket.blocks
        out = torch.empty(sum(blocks), dtype=send.dtype, device=send.device)
        self._wait(self.replicas, self.replicas.all_to_all(out, send, blocks, same))
        return out

    def _wait(self, comm: Communicator, handle: Handle | None) -> None:
        """Wait on one of the exchange's collectives: exposed communication."""
        mark = self.times.waits.start("all-to-all")
        comm.wait(handle)
        self.times.waits.stop(mark)
