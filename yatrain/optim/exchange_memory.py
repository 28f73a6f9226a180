"""The most memory Muon's exchange holds at once on a rank: one pure function of its plan.

``exchange.MatrixExchange.orthogonalize`` allocates, per bucket, a send buffer (this
replica's block of the rank's pieces, which the results come back into: S elements) and a
receive buffer (the pieces of the matrices the rank owns, orthogonalised in place: O). For
each owned matrix it assembles a copy and runs Newton-Schulz on it in 2mn + 2m^2 elements,
the copy included (``newton_schulz.workspace``; m <= n); under ``optim.muon_hsdp: split``
it then sends its block to every replica (c copies of S) and receives every replica's into
the bucket's results (T, the sum of the bucket's blocks). The pipeline keeps at most two
buckets: while bucket b's owners run Newton-Schulz, bucket b + 1 is in flight (sent before
it, both buffers live); bucket b - 1 has landed and let go before b + 1 went out. So the
peak is the largest, over the buckets, of

    S_b + O_b + S_b+1 + O_b+1 + W_b        (W_b: the workspace of b's largest owned matrix)
    S_b+1 + O_b+1 + c S_b + T_b             (split only: b's share, b + 1 in flight)

in the exchange's dtype. Not counted: the updates it reads and what the caller's ``land``
allocates (the optimizer's), the norm's two scalars (gone before the workspace's peak), and
buffers a communication library allocates itself.
"""

from __future__ import annotations

from yatrain.optim.exchange_plan import Bucket, ExchangePlan
from yatrain.optim.newton_schulz import workspace


def _live(bucket: Bucket | None) -> int:
    """Elements of a bucket in flight: its send and receive buffers."""
    return 0 if bucket is None else sum(bucket.in_splits) + sum(bucket.out_splits)


def exchange_peak_bytes(plan: ExchangePlan, itemsize: int) -> int:
    """The bytes ``plan``'s rank holds at the exchange's peak, in a dtype of ``itemsize``
    bytes (module docstring): what the planner adds to a Muon step's memory."""
    peak = 0
    buckets = plan.buckets
    for b, bucket in enumerate(buckets):
        following = _live(buckets[b + 1] if b + 1 < len(buckets) else None)
        shapes = [plan.shapes[k] for k in bucket.received]
        work = max((workspace(shape) for shape in shapes), default=0)
        peak = max(peak, _live(bucket) + following + work)
        if plan.copies > 1:
            share = plan.copies * sum(bucket.in_splits) + sum(bucket.blocks)
            peak = max(peak, following + share)
    return peak * itemsize
