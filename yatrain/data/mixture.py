"""Weighted mixtures of prepared data directories, defined on the global batch.

Weights are shares of training windows. The global sequence of window slots is dealt to the
sources by stride scheduling: source ``i``'s ``m``-th window is due at ``(m + 0.5) / w_i``,
and slots go to sources in order of due time (ties to the earlier source). So after ``n``
slots each source has had ``n * w_i`` windows to within about one, every global batch gets
its share rounded up or down, and the counts for any ``n`` are computed directly, without
replaying the run. Step ``k`` takes slots ``[k G, (k + 1) G)``; a source reads its windows
in a seeded order per epoch (``data/order.py``: evaluated per index, never materialised)
and, when it runs out, continues with the next epoch's (reshuffled). The step's windows are
then shuffled together, seeded by the step, so every micro-batch mixes sources. Everything
is a function of (seed, step): the same at any world size, and resumed exactly from the
step alone.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from yatrain.data.loader import BatchLoader, check_batching, resumed_order
from yatrain.data.order import FEISTEL, WindowOrder
from yatrain.data.shards import TokenShards
from yatrain.errors import DataError

_SOURCE_ORDER, _BATCH_ORDER = 1, 2  # seed-sequence tags: per-source epochs, per-step shuffle


def _due(picks: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Due time of each source's pick number ``picks`` (0-based)."""
    return (picks + 0.5) / weights


def _taken(time: float, weights: np.ndarray) -> np.ndarray:
    """Picks of each source due at or before ``time``."""
    count = np.maximum(np.floor(time * weights + 0.5), 0).astype(np.int64)
    count -= (count > 0) & (_due(count - 1, weights) > time)  # float rounding, either way
    count += _due(count, weights) <= time
    return count


def mixture_counts(weights: np.ndarray, slots: int) -> np.ndarray:
    """Windows each source gets among the first ``slots`` slots (see the module docstring)."""
    weights = np.asarray(weights, dtype=np.float64)
    if slots <= 0:
        return np.zeros(len(weights), dtype=np.int64)
    lo, hi = 0.0, float(slots)
    while _taken(hi, weights).sum() < slots:
        hi *= 2
    while True:  # bisect to adjacent floats: fewer than `slots` due by lo, enough by hi
        mid = (lo + hi) / 2
        if mid in (lo, hi):
            break
        if _taken(mid, weights).sum() >= slots:
            hi = mid
        else:
            lo = mid
    counts = _taken(lo, weights)
    rest = slots - int(counts.sum())
    tied = np.flatnonzero(_due(counts, weights) <= hi)  # due exactly at hi, source order
    counts[tied[:rest]] += 1
    return counts


class MixtureLoader(BatchLoader):
    """Global batches drawn from several data directories in proportion to their weights."""

    def __init__(
        self,
        sources: list[TokenShards],
        weights: list[float],
        seq_len: int,
        global_batch_size: int,
        micro_batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        *,
        document_mask: bool = False,
        restart_positions: bool = False,
        notice: Callable[[str], None] | None = None,
    ):
        check_batching(seq_len, global_batch_size, micro_batch_size, rank, world_size, seed)
        if not sources or len(sources) != len(weights) or min(weights) <= 0:
            raise DataError("a data mixture needs one positive weight per source")
        _check_same_tokenizer(sources)
        self.sources, self.seq_len, self.seed = sources, seq_len, seed
        self.weights = np.asarray(weights, dtype=np.float64) / float(np.sum(weights))
        self.num_windows = [s.windows(seq_len) for s in sources]
        for shards, windows in zip(sources, self.num_windows, strict=True):
            if windows == 0:
                raise DataError(
                    f"data source {shards.path} has no window of {seq_len}+1 tokens: add data "
                    "to it, drop it from data.sources, or lower data.seq_len"
                )
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.rank, self.world_size, self.step = rank, world_size, 0
        first = sources[0]
        self.tokenizer_files, self.vocab_size = first.tokenizer_files, first.vocab_size
        self.tokenizer_sha256 = first.tokenizer_sha256
        self.bos_id, self.eos_id = first.bos_id, first.eos_id
        self.document_mask, self.restart_positions = document_mask, restart_positions
        self.notice = notice or (lambda message: None)
        self._announced: set[int] = set()
        self.window_orders = [WindowOrder(FEISTEL, n) for n in self.num_windows]

    def consumed(self, step: int) -> np.ndarray:
        """Windows each source has given to steps ``0 .. step - 1``."""
        return mixture_counts(self.weights, step * self.global_batch_size)

    def _windows(self, source: int, first: int, end: int) -> np.ndarray:
        """The windows of ``source`` it gives at consumption indices ``[first, end)``: each
        index is (epoch, place in that epoch's order)."""
        epochs, places = np.divmod(np.arange(first, end, dtype=np.int64), self.num_windows[source])
        out = np.empty(len(places), dtype=np.int64)
        for epoch in np.unique(epochs).tolist():
            here = epochs == epoch
            key = [self.seed, _SOURCE_ORDER, source, epoch]
            out[here] = self.window_orders[source].at(key, places[here])
        return out

    def global_batch(self, step: int) -> np.ndarray:
        """[G, 2] (source, window) pairs of global step ``step``, in order (every rank)."""
        start, end = self.consumed(step), self.consumed(step + 1)
        pairs = np.concatenate(
            [
                np.stack([np.full(b - a, source, dtype=np.int64), self._windows(source, a, b)], 1)
                for source, (a, b) in enumerate(zip(start.tolist(), end.tolist(), strict=True))
            ]
        )
        order = np.random.default_rng([self.seed, _BATCH_ORDER, step]).permutation(len(pairs))
        return pairs[order]

    def next_batch(self):
        """This rank's ``accumulation_steps`` micro-batches of int64 [micro, seq_len] (x, y)."""
        self._announce_epochs(self.step)
        per_rank = self.global_batch_size // self.world_size
        pairs = self.global_batch(self.step)[self.rank * per_rank : (self.rank + 1) * per_rank]
        span = self.seq_len + 1
        tokens = np.stack(
            [self.sources[s].read(int(w) * self.seq_len, span) for s, w in pairs.tolist()]
        )
        self.step += 1
        return self._micro_batches(tokens)

    def _announce_epochs(self, step: int) -> None:
        """Say once per source when it runs out and starts its next (reshuffled) epoch."""
        before, after = self.consumed(step).tolist(), self.consumed(step + 1).tolist()
        for source, n in enumerate(self.num_windows):
            a, b = before[source], after[source]
            if source in self._announced or b == a or (b - 1) // n == max(a - 1, 0) // n:
                continue
            self._announced.add(source)
            epoch = (b - 1) // n + 1  # 1-based number of the epoch it moved into
            self.notice(
                f"data source {self.sources[source].path} used all its {n:,} windows at step "
                f"{step + 1}: continuing with epoch {epoch} (reshuffled)"
            )

    def describe(self, steps: int) -> str:
        """The realised shares of the first ``steps`` steps, next to the weights."""
        slots = steps * self.global_batch_size
        counts = self.consumed(steps)
        parts = [
            f"{Path(s.path).name} weight {w:.3f} -> {c / max(slots, 1):.3f} ({c:,} windows, "
            f"{c / n:.3g} epochs)"
            for s, w, c, n in zip(self.sources, self.weights, counts, self.num_windows, strict=True)
        ]
        return f"data mixture over {steps:,} steps ({slots:,} windows): " + "; ".join(parts)

    def state_dict(self) -> dict:
        """The step plus the mixture it is only valid for (positions follow from the step)."""
        return {
            "step": self.step,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "global_batch_size": self.global_batch_size,
            "mixture": self._mixture(),
            "order": self.window_orders[0].order,
        }

    def _mixture(self) -> list[dict]:
        return [
            {"num_windows": n, "weight": float(w)}
            for n, w in zip(self.num_windows, self.weights, strict=True)
        ]

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state["step"]``; world size and micro-batch size are free to differ."""
        mine = self.state_dict()
        for key in ("seed", "seq_len", "global_batch_size", "mixture"):
            if state.get(key) != mine[key]:
                raise DataError(
                    f"checkpoint data loader has {key}={state.get(key)}, this run has "
                    f"{mine[key]}: resume with the same data.sources (paths, weights, order), "
                    "seed, data.seq_len and data.global_batch_size"
                )
        step = state.get("step")
        if not isinstance(step, int) or step < 0:
            raise DataError(f"checkpoint data loader step {step!r} is invalid: use another one")
        order = resumed_order(state)
        self.window_orders = [WindowOrder(order, n) for n in self.num_windows]
        self.step = step


def _check_same_tokenizer(sources: list[TokenShards]) -> None:
    first = sources[0]
    for other in sources[1:]:
        facts = ("tokenizer_kind", "tokenizer_sha256", "bos_id", "eos_id", "vocab_size")
        differs = [f for f in facts if getattr(other, f) != getattr(first, f)]
        if differs:
            raise DataError(
                f"data sources {first.path} and {other.path} were prepared with different "
                f"tokenizers ({', '.join(differs)} differ): prepare every source with the "
                "same --tokenizer"
            )
