"""A training step never waits for the device: between log steps the host reads no device
value and synchronises with no stream, on both engine paths (gloo's, and the CUDA path on
the stand-in streams), counted from outside by ``testing.host_syncs``; and a run logged every
5 steps computes bit for bit what one logged every step computes.

End to end because what is counted is the whole loop (data, step, guard, meter, loggers) of
real two-rank gloo runs."""

from __future__ import annotations

import contextlib

import pytest
import torch
from conftest import FAST, ROOT
from distributed import run_ranks
from test_checkpoint import full_state, inject_inf_gradient, losses, train

from yatrain.checkpoint import store as ckpt
from yatrain.errors import TrainingError
from yatrain.output.record import read_metrics
from yatrain.recipe.load import load_recipe
from yatrain.testing import cuda_standin
from yatrain.testing.host_syncs import HostSyncCounter
from yatrain.train import loop
from yatrain.train import step as step_module
from yatrain.train.loop import pretrain

STEPS, LOG_EVERY = 8, 4  # logged: 1, 4, 8
READ_STEPS = {1, 4, 8}


def _counted(rank: int, world: int, data, run_dir, cuda_path: bool, plant: bool):
    """Host waits counted in each loop iteration (its step and whatever follows it), and
    the stand-in streams' event records (the CUDA path ran)."""
    counter = HostSyncCounter()
    started: dict[int, int] = {}
    real_step, real_update = loop.step, step_module.step_unless

    def counted_step(run, step_number, guard):
        started[step_number] = counter.total()
        return real_step(run, step_number, guard)

    def planted_update(optimizer, skip):
        skip.item()  # one read of a device value inside the step
        return real_update(optimizer, skip)

    overrides = [*FAST, f"data.path={data}", f"train.log_every={LOG_EVERY}"]
    recipe = load_recipe(ROOT / "recipes/tiny.yaml", [*overrides, "checkpoint.enabled=false"])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loop, "step", counted_step)
        if plant:
            patch.setattr(step_module, "step_unless", planted_update)
        order = cuda_standin.as_if_cuda(patch) if cuda_path else None
        with contextlib.ExitStack() as stack:
            if order is not None:
                stack.enter_context(order.recording())
            with counter:
                pretrain(recipe, run_dir=run_dir / f"rank{rank}", steps=STEPS, progress=False)
            ended = counter.total()
    bounds = [*(started[s] for s in sorted(started)), ended]
    records = sum(n for k, n in order.counts.items() if k.startswith("record on")) if order else 0
    return {s: bounds[i + 1] - bounds[i] for i, s in enumerate(sorted(started))}, records


@pytest.mark.parametrize("cuda_path", [False, True], ids=["gloo path", "cuda path stand-in"])
def test_no_host_read_between_log_steps(small_data, tmp_path, cuda_path):
    for counts, event_records in run_ranks(2, _counted, small_data, tmp_path, cuda_path, False):
        assert (event_records > 0) == cuda_path
        quiet = {s: n for s, n in counts.items() if s not in READ_STEPS}
        assert quiet == dict.fromkeys(quiet, 0), counts
        assert all(counts[s] > 0 for s in READ_STEPS), counts  # the counter sees log reads


def test_one_planted_read_in_the_step_is_counted(small_data, tmp_path):
    for counts, _ in run_ranks(2, _counted, small_data, tmp_path, False, True):
        assert all(counts[s] >= 1 for s in counts if s not in READ_STEPS), counts


def _final_state_and_records(data, run_dir, log_every: int):
    overrides = [*FAST, f"data.path={data}", f"train.log_every={log_every}"]
    recipe = load_recipe(ROOT / "recipes/tiny.yaml", [*overrides, "checkpoint.every=0"])
    pretrain(recipe, run_dir=run_dir, steps=STEPS, progress=False)
    records = {r.step: (r.loss, r.grad_norm) for r in read_metrics(run_dir / "metrics.jsonl")}
    return full_state(run_dir / f"checkpoints/step-{STEPS}", run_dir), records


def test_logging_every_few_steps_trains_bit_for_bit_as_logging_every_step(small_data, tmp_path):
    every, few = (_final_state_and_records(small_data, tmp_path / f"r{n}", n) for n in (1, 4))
    assert set(few[1]) == READ_STEPS
    assert {s: every[1][s] for s in READ_STEPS} == few[1]
    assert every[0].keys() == few[0].keys()
    assert all(torch.equal(every[0][key], few[0][key]) for key in every[0])


def _weights_made_non_finite_at(monkeypatch, at_step: int) -> None:
    """After the update of step ``at_step`` one master weight is NaN, as a bad update makes."""
    real, calls = step_module.step_unless, []

    def update(optimizer, skip):
        real(optimizer, skip)
        calls.append(None)
        if len(calls) == at_step:
            optimizer.param_groups[0]["params"][0].data.view(-1)[0] = float("nan")

    monkeypatch.setattr(step_module, "step_unless", update)


def test_weights_made_non_finite_stop_the_run_at_the_next_log_step(
    small_data, tmp_path, monkeypatch
):
    _weights_made_non_finite_at(monkeypatch, at_step=2)
    with pytest.raises(TrainingError, match="the update at step 2 made weights non-finite"):
        train(small_data, tmp_path / "run", 6, "train.log_every=4", "checkpoint.every=0")
    assert list(losses(tmp_path / "run")) == [1]  # stopped at step 4, before logging it


def test_a_save_reads_the_weights_check_first_and_keeps_the_last_good_checkpoint(
    small_data, tmp_path, monkeypatch
):
    _weights_made_non_finite_at(monkeypatch, at_step=3)
    with pytest.raises(TrainingError, match="step 3 made .* last good checkpoint is .*step-2"):
        train(small_data, tmp_path / "run", 8, "train.log_every=8", "checkpoint.every=2")
    saved = ckpt.complete_checkpoints(tmp_path / "run" / "checkpoints")
    assert [p.name for p in saved] == ["step-2"]  # step-4 was never written


def test_a_non_finite_step_stops_the_run_at_the_next_log_step_naming_it(
    small_data, tmp_path, monkeypatch
):
    inject_inf_gradient(monkeypatch, at_step=2)
    with pytest.raises(TrainingError, match=r"non-finite loss or gradient norm at step 2;"):
        train(small_data, tmp_path / "run", 6, "train.log_every=4", "checkpoint.every=0")


def test_skipped_steps_are_counted_at_the_next_log_step(small_data, tmp_path, monkeypatch, capfd):
    inject_inf_gradient(monkeypatch, at_step=2)
    summary = train(
        small_data, tmp_path / "run", 5, "train.log_every=4", "train.skip_nonfinite_steps=true"
    )
    assert summary["skipped_steps"] == 1
    assert "warning: step 2 skipped (non-finite loss or gradient norm)" in capfd.readouterr().err
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [(r.step, r.skipped_steps) for r in records] == [(1, 0), (4, 1), (5, 1)]
