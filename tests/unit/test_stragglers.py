"""The straggler note: a streak belongs to one rank (a different rank lagging starts a new
one), and only ``STRAGGLER_LOGS`` logs in a row of the same rank name it."""

from __future__ import annotations

from yatrain.runtime.stragglers import STRAGGLER_LOGS, StragglerWatch


def test_different_ranks_lagging_once_each_name_no_straggler():
    watch = StragglerWatch()
    notes = [watch.note(rank, 2.0, 1.0) for rank in (1, 2, 3, 1, 2, 3)]
    assert notes == [None] * 6


def test_one_rank_lagging_logs_in_a_row_is_named():
    watch = StragglerWatch()
    assert watch.note(1, 2.0, 1.0) is None  # another rank's streak, then rank 3's
    notes = [watch.note(3, 2.0, 1.0) for _ in range(STRAGGLER_LOGS)]
    assert notes[:-1] == [None] * (STRAGGLER_LOGS - 1)
    assert notes[-1].startswith("straggler: rank 3 is 2.0x slower than the median")
    assert f"{STRAGGLER_LOGS} logs in a row" in notes[-1]
    assert watch.note(3, 1.0, 1.0) is None and watch.note(3, 2.0, 1.0) is None  # broken: anew
