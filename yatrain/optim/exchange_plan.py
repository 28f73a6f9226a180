"""Who owns which matrix for Muon and which pieces go where, bucket by bucket: on paper.

Each rank of a shard group holds a contiguous piece of every unit, so a weight matrix lies
across one or a few ranks. The units (decoder layers) are grouped into buckets of
consecutive units, each about ``bucket_numel`` elements of whole matrices, exchanged one
after another (``exchange.MatrixExchange``). Each matrix gets one owner, chosen by longest
processing time first over its Newton-Schulz FLOPs (4 m^2 n + 2 m^3, m <= n; not its size),
bucket after bucket on the loads so far (so each bucket's work is spread over the ranks and
the whole step's balanced), the same on every rank. In a bucket each rank sends its pieces
of the bucket's matrices to their owners (owner by owner, matrix order within each), and
gets the orthogonalised pieces back where it sent them.

Under hybrid sharding with the owners split over the world (``copies`` replicas), owner w
is rank w % size of replica w // size; a bucket's results for this rank's pieces are laid
out replica by replica (``blocks``), this replica's own block at ``base``. Pure: the planner
builds one for any rank without a process group (``exchange_memory``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from yatrain.sharding.layout import MatrixMap

Held = tuple[int, int, int, int, int]  # (matrix, unit, in_shard, in_matrix, length) of a piece


def assign_owners(costs: Sequence[int], ranks: int, buckets: Sequence[int] = ()) -> list[int]:
    """The owner of each job: the costliest first, each to the least loaded rank (ties: the
    lower rank, then the earlier job), so every rank computes the same answer. ``buckets``:
    how many consecutive jobs each bucket has (none: one bucket), placed bucket after
    bucket on the loads so far."""
    load, owner, start = [0] * ranks, [0] * len(costs), 0
    for count in buckets or [len(costs)]:
        for job in sorted(range(start, start + count), key=lambda j: (-costs[j], j)):
            rank = min(range(ranks), key=lambda r: (load[r], r))
            owner[job], load[rank] = rank, load[rank] + costs[job]
        start += count
    return owner


def ns_cost(shape: torch.Size) -> int:
    """A Newton-Schulz iteration's FLOPs on an m x n matrix (m <= n): the Gram X X^T and the
    product with X, 2 m^2 n each, and the Gram's square, 2 m^3 (``newton_schulz.zeropower``)."""
    small, large = sorted((shape[0], shape[1]))
    return 4 * small * small * large + 2 * small**3


def bucket_numel(mib: float | None, dtype: torch.dtype) -> int | None:
    """``optim.muon_bucket_mib`` in elements of the exchange's dtype (None: one bucket)."""
    return None if mib is None else max(1, int(mib * 2**20) // dtype.itemsize)


def group_units(maps: Sequence[MatrixMap], numel: int | None, owners: int = 1) -> list[range]:
    """Consecutive units in buckets of at most ``numel`` matrix elements (a larger unit
    alone), each of at least ``owners`` matrices (a shorter last one joins the one
    before): a bucket with fewer leaves owners idle while the step waits for its few in
    turn (70B on 256 ranks in buckets of one layer's 7 matrices: Newton-Schulz 45% of the
    step at H100 peak, against 1.1% so; docs/optimizers.md). None: every unit in one
    bucket."""
    buckets: list[range] = []
    start, size, matrices = 0, 0, 0
    for unit, m in enumerate(maps):
        elements = sum(shape.numel() for shape in m.shapes)
        full = size + elements > numel if numel is not None else False
        if unit > start and full and matrices >= owners:
            buckets.append(range(start, unit))
            start, size, matrices = unit, 0, 0
        size += elements
        matrices += len(m.shapes)
    if not maps:
        return []
    if buckets and matrices < owners:  # too few left for a bucket of their own
        return [*buckets[:-1], range(buckets[-1].start, len(maps))]
    return [*buckets, range(start, len(maps))]


@dataclass(frozen=True)
class Sent:
    """One piece this rank sends: ``length`` elements at ``in_shard`` of unit ``unit``'s
    shard (its place in the optimizer's list), of matrix ``matrix``, at ``at`` in its
    bucket's results (replica by replica; this replica's block is also the send buffer,
    from the bucket's ``base``)."""

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


@dataclass(frozen=True)
class Bucket:
    """One bucket's exchange on this rank: what it sends (``sent``, ``in_splits`` elements
    to each group rank), receives (``out_splits`` from each; ``received``: each owned
    matrix's pieces) and gets back from every replica (``blocks``, its own at ``base``)."""

    units: range
    sent: tuple[Sent, ...]
    in_splits: list[int]
    out_splits: list[int]
    received: dict[int, list[Received]]
    blocks: list[int]
    base: int


def _held(maps: Sequence[MatrixMap], rank: int) -> list[Held]:
    """The pieces ``rank``'s shards hold, in matrix order (matrices numbered across units)."""
    first = [sum(len(m.shapes) for m in maps[:u]) for u in range(len(maps))]
    found = [
        (first[u] + p.slot, u, p.in_shard, p.in_matrix, p.length)
        for u, m in enumerate(maps)
        for p in m.pieces[rank]
    ]
    return sorted(found)


class ExchangePlan:
    """Owners, buckets and this rank's pieces for the units ``maps`` (module docstring):
    rank ``rank`` of a shard group of ``size``, of replica ``replica`` of ``copies`` over
    which the owners are split (1: each group owns every matrix)."""

    def __init__(
        self,
        maps: Sequence[MatrixMap],
        rank: int,
        size: int,
        replica: int = 0,
        copies: int = 1,
        bucket_numel: int | None = None,
    ) -> None:
        self.rank, self.size, self.me, self.copies = rank, size, replica, copies
        self.shapes = [shape for m in maps for shape in m.shapes]
        units = group_units(maps, bucket_numel, size * copies)
        counts = [sum(len(maps[u].shapes) for u in bucket) for bucket in units]
        world = assign_owners([ns_cost(s) for s in self.shapes], size * copies, counts)
        self.owner = [w % size for w in world]
        self.replica = [w // size for w in world]
        bucket_of = {u: i for i, bucket in enumerate(units) for u in bucket}
        held: list[list[list[Held]]] = [[[] for _ in units] for _ in range(size)]
        for r in range(size):
            for piece in _held(maps, r):
                held[r][bucket_of[piece[1]]].append(piece)
        self.buckets = [
            self._bucket(bucket, [pieces[i] for pieces in held]) for i, bucket in enumerate(units)
        ]
        # Each replica's elements of this rank's results over the step (each bucket's blocks).
        self.blocks = [sum(b.blocks[c] for b in self.buckets) for c in range(copies)]

    def _mine(self, matrix: int, rank: int) -> bool:
        """Does group rank ``rank`` of this replica own ``matrix``?"""
        return self.owner[matrix] == rank and self.replica[matrix] == self.me

    def _bucket(self, units: range, inside: list[list[Held]]) -> Bucket:
        """The bucket of ``units``: ``inside`` is every group rank's pieces of its matrices."""
        sent: list[Sent] = []
        blocks: list[int] = []
        in_splits = [0] * self.size
        for copy in range(self.copies):
            splits = [0] * self.size
            for dest in range(self.size):
                for k, unit, in_shard, _, length in inside[self.rank]:
                    if self.owner[k] == dest and self.replica[k] == copy:
                        sent.append(Sent(unit, in_shard, length, k, sum(blocks) + sum(splits)))
                        splits[dest] += length
            blocks.append(sum(splits))
            in_splits = splits if copy == self.me else in_splits
        received: dict[int, list[Received]] = {}
        out_splits = [0] * self.size
        for src in range(self.size):
            for k, _, _, in_matrix, length in inside[src]:
                if self._mine(k, self.rank):
                    piece = Received(sum(out_splits), in_matrix, length)
                    received.setdefault(k, []).append(piece)
                    out_splits[src] += length
        base = sum(blocks[: self.me])
        return Bucket(units, tuple(sent), in_splits, out_splits, received, blocks, base)

    def bytes_sent(self, dtype: torch.dtype) -> int:
        """What this rank sends a step in both all-to-alls of every bucket within its group,
        what it keeps excluded (the communicator counts the same; ``traffic.step_traffic``'s
        ``exchanged``)."""
        total = 0
        for b in self.buckets:
            there = sum(b.in_splits) - b.in_splits[self.rank]
            back = sum(b.out_splits) - b.out_splits[self.rank]
            total += there + back
        return total * dtype.itemsize

    def bytes_across(self, dtype: torch.dtype) -> int:
        """What this rank sends the other replicas a step (its own block of each bucket to
        each); 0 unless the owners are split over the replicas (``step_traffic``'s
        ``across``). The replicas' communicator counts it."""
        return (self.copies - 1) * self.blocks[self.me] * dtype.itemsize
