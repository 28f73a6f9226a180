"""Whole matrices for Muon: one owner rank per matrix, reached by two all-to-alls a step.

Each rank of a shard group holds a contiguous piece of every unit, so a weight matrix lies
across one or a few ranks. Each matrix gets one owner in the group, chosen by longest
processing time first over its Newton-Schulz cost (max(m, n) x min(m, n)^2, not its size),
the same on every rank. A step, each rank sends its pieces of every matrix's update to the
matrix's owner (one all-to-all with uneven splits, padding excluded), the owner assembles and
orthogonalises its matrices and sends each piece back where it came from (a second one, the
splits swapped), in the same order, so each rank receives its pieces where it sent them.

Under hybrid sharding the replicas hold the same shards once their gradients are all-reduced,
so one owner per matrix in the whole world suffices (``optim.muon_hsdp: split``, given the
replicas' communicator): owners are chosen over shard ranks x replicas, each replica's group
exchanges only the matrices its ranks own, and a third all-to-all across the replicas (rank i
of each) hands every replica the results the others computed for its pieces. Without it
(``repeat``) every replica orthogonalises every matrix itself: no traffic across replicas,
the Newton-Schulz work repeated once per replica.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from yatrain.optim.newton_schulz import zeropower
from yatrain.sharding.comm import Communicator
from yatrain.sharding.layout import MatrixMap

Held = tuple[int, int, int, int, int]  # (matrix, unit, in_shard, in_matrix, length) of a piece


def assign_owners(costs: Sequence[int], ranks: int) -> list[int]:
    """The owner of each job: the costliest first, each to the least loaded rank (ties: the
    lower rank, then the earlier job), so every rank computes the same answer."""
    load, owner = [0] * ranks, [0] * len(costs)
    for job in sorted(range(len(costs)), key=lambda j: (-costs[j], j)):
        rank = min(range(ranks), key=lambda r: (load[r], r))
        owner[job], load[rank] = rank, load[rank] + costs[job]
    return owner


def ns_cost(shape: torch.Size) -> int:
    """A Newton-Schulz iteration's work on a matrix: max(m, n) x min(m, n)^2."""
    small, large = sorted((shape[0], shape[1]))
    return large * small * small


@dataclass(frozen=True)
class Sent:
    """One piece this rank sends: ``length`` elements at ``in_shard`` of unit ``unit``'s
    shard (its place in the optimizer's list), of matrix ``matrix``, at ``at`` in the
    send buffer (and where its orthogonalised elements come back)."""

    unit: int
    in_shard: int
    length: int
    matrix: int
    at: int


@dataclass(frozen=True)
class Received:
    """One piece of an owned matrix: ``length`` elements at ``at`` of the receive buffer,
    from ``in_matrix`` of the flattened matrix."""

    at: int
    in_matrix: int
    length: int


def _held(maps: Sequence[MatrixMap], rank: int) -> list[Held]:
    """The pieces ``rank``'s shards hold, in matrix order (matrices numbered across units)."""
    first = [sum(len(m.shapes) for m in maps[:u]) for u in range(len(maps))]
    found = [
        (first[u] + p.slot, u, p.in_shard, p.in_matrix, p.length)
        for u, m in enumerate(maps)
        for p in m.pieces[rank]
    ]
    return sorted(found)


class MatrixExchange:
    """Who owns which matrix of the units ``maps`` and what this rank sends and receives.

    ``replicas``: the replicas' communicator (rank i of every shard group) to split the
    owners over the whole world; None orthogonalises every matrix in each group. ``sent``
    lists every piece this rank holds, at its place in what ``orthogonalize`` returns:
    replica by replica (``blocks``: each one's elements), in each one's exchange order."""

    def __init__(
        self, maps: Sequence[MatrixMap], comm: Communicator, replicas: Communicator | None = None
    ) -> None:
        self.comm, self.replicas = comm, replicas
        size, copies = comm.world_size, replicas.world_size if replicas else 1
        self.me = replicas.rank if replicas else 0  # this rank's replica
        self.shapes = [shape for m in maps for shape in m.shapes]
        # World owner w is rank w % size of replica w // size (any fixed order would do).
        world = assign_owners([ns_cost(s) for s in self.shapes], size * copies)
        self.owner = [w % size for w in world]
        self.replica = [w // size for w in world]
        held = [_held(maps, r) for r in range(size)]
        self.sent: list[Sent] = []
        self.blocks: list[int] = []
        splits = []
        for copy in range(copies):
            splits.append(self._send(held[comm.rank], copy, sum(self.blocks)))
            self.blocks.append(sum(splits[-1]))
        self.in_splits = splits[self.me]
        self.base = sum(self.blocks[: self.me])  # where this replica's own block starts
        self.received: dict[int, list[Received]] = {
            k: [] for k in range(len(self.shapes)) if self._mine(k, comm.rank)
        }
        self.out_splits = [0] * size
        for src in range(size):
            for k, _, _, in_matrix, length in held[src]:
                if self._mine(k, comm.rank):
                    self.received[k].append(Received(sum(self.out_splits), in_matrix, length))
                    self.out_splits[src] += length

    def _mine(self, matrix: int, rank: int) -> bool:
        """Does group rank ``rank`` of this replica own ``matrix``?"""
        return self.owner[matrix] == rank and self.replica[matrix] == self.me

    def _send(self, held: list[Held], copy: int, base: int) -> list[int]:
        """Append to ``sent`` this rank's pieces of the matrices replica ``copy`` owns, from
        ``base`` on, owner by owner; returns how many elements go to each owner."""
        splits = [0] * self.comm.world_size
        for dest in range(self.comm.world_size):
            for k, unit, in_shard, _, length in held:
                if self.owner[k] == dest and self.replica[k] == copy:
                    self.sent.append(Sent(unit, in_shard, length, k, base + sum(splits)))
                    splits[dest] += length
        return splits

    def bytes_sent(self, dtype: torch.dtype) -> int:
        """What this rank sends a step in both all-to-alls within its group, what it keeps
        excluded (the communicator counts the same; ``traffic.step_traffic``'s
        ``exchanged``)."""
        me = self.comm.rank
        there = sum(self.in_splits) - self.in_splits[me]
        back = sum(self.out_splits) - self.out_splits[me]
        return (there + back) * dtype.itemsize

    def bytes_across(self, dtype: torch.dtype) -> int:
        """What this rank sends the other replicas a step (its own block to each); 0 unless
        the owners are split over the replicas. The replicas' communicator counts it."""
        return (len(self.blocks) - 1) * self.blocks[self.me] * dtype.itemsize

    def orthogonalize(
        self, updates: Sequence[torch.Tensor], steps: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """Every matrix of ``updates`` (each unit's flat shard) orthogonalised by its owner;
        returns this rank's pieces of them in ``dtype``, laid out as ``sent`` says."""
        source = torch.empty(sum(self.in_splits), dtype=dtype, device=updates[0].device)
        for piece in self.sent:
            if self.replica[piece.matrix] == self.me:
                at = source.narrow(0, piece.at - self.base, piece.length)
                at.copy_(updates[piece.unit].narrow(0, piece.in_shard, piece.length))
        owned = torch.empty(sum(self.out_splits), dtype=dtype, device=source.device)
        self.comm.wait(self.comm.all_to_all(owned, source, self.out_splits, self.in_splits))
        done = torch.empty_like(owned)
        for k, pieces in self.received.items():
            shape = self.shapes[k]
            matrix = torch.empty(shape.numel(), dtype=dtype, device=owned.device)
            for p in pieces:
                matrix.narrow(0, p.in_matrix, p.length).copy_(owned.narrow(0, p.at, p.length))
            flat = zeropower(matrix.view(shape), steps, dtype).reshape(-1)
            for p in pieces:
                done.narrow(0, p.at, p.length).copy_(flat.narrow(0, p.in_matrix, p.length))
        back = torch.empty_like(source)
        self.comm.wait(self.comm.all_to_all(back, done, self.in_splits, self.out_splits))
        return self._share(back)

    def _share(self, back: torch.Tensor) -> torch.Tensor:
        """Every replica's results for this rank's pieces, given this replica's ``back``:
        each owner's result reaches the matching rank of every replica, its own by the
        group's all-to-all, the others by one across the replicas (rank i of each)."""
        if self.replicas is None:
            return back
        out = torch.empty(sum(self.blocks), dtype=back.dtype, device=back.device)
        send = back.repeat(len(self.blocks))
        same = [back.numel()] * len(self.blocks)  # the same block to every replica
        self.replicas.wait(self.replicas.all_to_all(out, send, self.blocks, same))
        return out
