"""Whole matrices for Muon: one owner rank per matrix, reached by two all-to-alls a step.

Each rank of a shard group holds a contiguous piece of every unit, so a weight matrix lies
across one or a few ranks. Each matrix gets one owner in the group, chosen by longest
processing time first over its Newton-Schulz cost (max(m, n) x min(m, n)^2, not its size),
the same on every rank. A step, each rank sends its pieces of every matrix's update to the
matrix's owner (one all-to-all with uneven splits, padding excluded), the owner assembles and
orthogonalises its matrices and sends each piece back where it came from (a second one, the
splits swapped), in the same order, so each rank receives its pieces where it sent them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from yatrain.optim.newton_schulz import zeropower
from yatrain.sharding.comm import Communicator
from yatrain.sharding.layout import MatrixMap


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


class MatrixExchange:
    """Who owns which matrix of the units ``maps`` and what this rank sends and receives."""

    def __init__(self, maps: Sequence[MatrixMap], comm: Communicator) -> None:
        self.comm, rank, size = comm, comm.rank, comm.world_size
        self.shapes = [shape for m in maps for shape in m.shapes]
        first = [sum(len(m.shapes) for m in maps[:u]) for u in range(len(maps))]
        self.owner = assign_owners([ns_cost(s) for s in self.shapes], size)

        def held(r: int) -> list[tuple[int, int, int, int, int]]:
            # (matrix, unit, in_shard, in_matrix, length) of each piece rank r holds
            found = [
                (first[u] + p.slot, u, p.in_shard, p.in_matrix, p.length)
                for u, m in enumerate(maps)
                for p in m.pieces[r]
            ]
            return sorted(found)

        self.sent: list[Sent] = []
        self.in_splits = [0] * size
        for dest in range(size):
            for k, unit, in_shard, _, length in held(rank):
                if self.owner[k] == dest:
                    self.sent.append(Sent(unit, in_shard, length, k, sum(self.in_splits)))
                    self.in_splits[dest] += length
        self.received: dict[int, list[Received]] = {
            k: [] for k in range(len(self.shapes)) if self.owner[k] == rank
        }
        self.out_splits = [0] * size
        for src in range(size):
            for k, _, _, in_matrix, length in held(src):
                if self.owner[k] == rank:
                    self.received[k].append(Received(sum(self.out_splits), in_matrix, length))
                    self.out_splits[src] += length

    def bytes_sent(self, dtype: torch.dtype) -> int:
        """What this rank sends a step in both all-to-alls, what it keeps excluded (the
        communicator counts the same; ``traffic.step_traffic``'s ``exchanged``)."""
        me = self.comm.rank
        there = sum(self.in_splits) - self.in_splits[me]
        back = sum(self.out_splits) - self.out_splits[me]
        return (there + back) * dtype.itemsize

    def orthogonalize(
        self, updates: Sequence[torch.Tensor], steps: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """Every matrix of ``updates`` (each unit's flat shard) orthogonalised by its owner;
        returns this rank's pieces of them in ``dtype``, laid out as ``sent`` says."""
        source = torch.empty(sum(self.in_splits), dtype=dtype, device=updates[0].device)
        for piece in self.sent:
            at = source.narrow(0, piece.at, piece.length)
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
        return back
