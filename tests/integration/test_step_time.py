"""The step-time breakdown: every record splits its step into timed parts, and a delay
injected into each gather shows up as exposed communication, that delay times the gathers."""

from __future__ import annotations

import time

import pytest
from conftest import FAST, ROOT
from distributed import run_ranks

from yatrain.output.console import BREAKDOWN
from yatrain.output.record import read_metrics
from yatrain.recipe.load import load_recipe
from yatrain.sharding import comm
from yatrain.train.loop import pretrain

DELAY_S = 0.2  # added to the wait of every all-gather in the slowed run
STEPS = 4
QUIET = ["checkpoint.enabled=false", "train.log_every=2"]  # no save gathers outside steps


class _SlowWork:
    """A gather's work whose ``wait`` first sleeps ``DELAY_S`` (as a slow link would)."""

    def __init__(self, work, counter: list[int]) -> None:
        self.work, self.counter = work, counter

    def wait(self):
        self.counter[0] += 1
        time.sleep(DELAY_S)
        return self.work.wait()

    def is_completed(self) -> bool:
        return self.work.is_completed()


def _timed_run(rank: int, world: int, data, run_dir, delay: bool) -> tuple[list, int]:
    """(rank 0's records with the steps each covers, gathers waited) of one run."""
    counter = [0]
    real = comm.GlooCommunicator.all_gather
    if delay:

        def slow_gather(self, out, shard):
            handle = real(self, out, shard)
            handle.work = _SlowWork(handle.work, counter)
            return handle

        comm.GlooCommunicator.all_gather = slow_gather
    try:
        recipe = load_recipe(ROOT / "recipes/tiny.yaml", [*FAST, f"data.path={data}", *QUIET])
        pretrain(recipe, run_dir=run_dir, steps=STEPS, progress=False)
    finally:
        comm.GlooCommunicator.all_gather = real
    records = read_metrics(run_dir / "metrics.jsonl")
    steps = [r.step - previous.step for previous, r in zip(records, records[1:], strict=False)]
    return list(zip([records[0].step, *steps], records, strict=True)), counter[0]


def _both_runs(rank: int, world: int, data, tmp) -> tuple:
    base, _ = _timed_run(rank, world, data, tmp / "base", delay=False)
    slowed, gathers = _timed_run(rank, world, data, tmp / "slow", delay=True)
    return base, slowed, gathers


def _total(windows: list, key: str) -> float:
    """A part's seconds summed over the run's steps."""
    return sum(n * getattr(r, key) for n, r in windows)


@pytest.fixture(scope="module")
def delayed(small_data, tmp_path_factory) -> tuple:
    """Rank 0's (plain run, run with every gather slowed, gathers waited), 2 ranks."""
    (result, _) = run_ranks(2, _both_runs, small_data, tmp_path_factory.mktemp("timed"))
    return result


def test_a_delay_in_each_gather_is_exposed_communication(delayed):
    """Rank 0's records (the ones logged): the slowed run's exposed communication exceeds
    the plain run's by the delay times the gathers rank 0 waited on, within 10%."""
    base, slowed, gathers = delayed
    assert gathers >= 4 * STEPS  # embedding, 2 layers, head, at least once a step
    added = _total(slowed, "comm_exposed_s") - _total(base, "comm_exposed_s")
    assert added == pytest.approx(gathers * DELAY_S, rel=0.10)


def test_injected_gather_delay_leaves_compute_unchanged(delayed):
    """The waits are taken out of the model phase: compute does not grow by the delay (it
    would by all of it if waits were counted as compute)."""
    base, slowed, gathers = delayed
    grown = _total(slowed, "compute_s") - _total(base, "compute_s")
    assert grown < 0.25 * gathers * DELAY_S, (grown, gathers * DELAY_S)


def test_no_part_of_a_step_is_negative_with_or_without_delay(delayed):
    base, slowed, _ = delayed
    for _, record in [*base, *slowed]:
        parts = {key: getattr(record, key) for key in BREAKDOWN}
        assert all(value >= -1e-6 for value in parts.values()), parts


def test_every_record_splits_its_step_into_parts(small_data, tmp_path):
    overrides = [*FAST, f"data.path={small_data}", "checkpoint.every=2"]
    recipe = load_recipe(ROOT / "recipes/tiny.yaml", overrides)
    pretrain(recipe, run_dir=tmp_path / "run", steps=4, progress=False)
    records = read_metrics(tmp_path / "run/metrics.jsonl")
    assert [r.step for r in records] == [1, 2, 3, 4]
    for r in records:
        parts = [getattr(r, key) for key in BREAKDOWN]
        assert all(part >= -1e-6 for part in parts) and r.compute_s > 0, r
        assert sum(parts) == pytest.approx(r.step_time_s, rel=1e-9)  # the rest is unattributed
        assert r.slowest_rank == 0 and r.slowest_busy_s == r.median_busy_s > 0
    # a save is outside the step time, reported beside it in the next record (it follows
    # the log of its step)
    assert [r.checkpoint_s > 0 for r in records] == [False, False, True, False]
    assert all(r.eval_s == 0 for r in records)
