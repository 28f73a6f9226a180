"""The guard decides on the device: a non-finite step is skipped by the optimizer itself
(weights and state bitwise unchanged, for fused AdamW and for the masked fallback), counted
on the device, and read by the host only when it asks (``settle``)."""

import pytest
import torch

from yatrain.optim import step_unless
from yatrain.testing.host_syncs import HostSyncCounter
from yatrain.train.guard import StepGuard

INF, NAN = float("inf"), float("nan")


@pytest.fixture
def guard():
    made = StepGuard(torch.device("cpu"))
    yield made
    made.restore()


def _optimizer(fused: bool) -> torch.optim.AdamW:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(37)), torch.nn.Parameter(torch.randn(5))]
    kind = {"fused": True} if fused else {"foreach": True}
    return torch.optim.AdamW(params, lr=0.1, weight_decay=0.1, **kind)


def _everything(optimizer) -> list[torch.Tensor]:
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state = [v for p in params for v in optimizer.state[p].values() if torch.is_tensor(v)]
    return [t.detach().clone() for t in [*params, *state]]


def _grads(optimizer, value: float | None = None) -> None:
    for p in (p for g in optimizer.param_groups for p in g["params"]):
        p.grad = torch.full_like(p, value) if value is not None else torch.randn_like(p)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "masked fallback"])
@pytest.mark.parametrize("bad", [INF, NAN])
def test_a_skipped_step_leaves_weights_and_state_bitwise_unchanged(fused, bad):
    optimizer = _optimizer(fused)
    _grads(optimizer)
    optimizer.step()  # the state exists
    before = _everything(optimizer)
    _grads(optimizer, bad)
    step_unless(optimizer, torch.tensor(1.0))
    assert all(torch.equal(a, b) for a, b in zip(before, _everything(optimizer), strict=True))


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "masked fallback"])
def test_a_step_not_skipped_is_the_optimizers_own_step(fused):
    optimizer, reference = _optimizer(fused), _optimizer(fused)
    for made in (optimizer, reference):
        torch.manual_seed(2)
        _grads(made)
    reference.step()
    step_unless(optimizer, torch.tensor(0.0))
    assert all(
        torch.equal(a, b)
        for a, b in zip(_everything(reference), _everything(optimizer), strict=True)
    )


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "masked fallback"])
def test_a_skipped_first_step_leaves_the_next_step_a_first_step(fused):
    optimizer, fresh = _optimizer(fused), _optimizer(fused)
    _grads(optimizer, NAN)
    step_unless(optimizer, torch.tensor(1.0))
    torch.manual_seed(1)
    _grads(optimizer)
    torch.manual_seed(1)
    _grads(fresh)
    step_unless(optimizer, torch.tensor(0.0))
    fresh.step()
    assert all(
        torch.equal(a, b) for a, b in zip(_everything(fresh), _everything(optimizer), strict=True)
    )


def test_the_skip_flag_is_exactly_zero_or_one_and_read_only_when_settled(guard):
    finite, counter = torch.tensor(2.5), HostSyncCounter()
    with counter:
        flags = []
        for step, (loss, norm) in enumerate(
            [
                (finite, finite),
                (finite, torch.tensor(INF)),
                (torch.tensor(NAN), finite),
                (finite, finite),
            ],  # fmt: skip
            start=7,
        ):
            guard.step_number = step
            flags.append(guard.nonfinite(loss, norm))
        assert counter.total() == 0  # nothing read yet
    assert [f.dtype for f in flags] == [torch.float32] * 4
    assert [f.tolist() for f in flags] == [0.0, 1.0, 1.0, 0.0]
    found = guard.settle()
    assert (found.skipped, found.first_skipped, found.bad_weights_step) == (2, 8, None)
    assert guard.settle().skipped == 0  # counted once


def test_the_first_update_that_made_weights_non_finite_is_kept(guard):
    weights = [torch.ones(10), torch.full((3,), 3e38)]  # huge but finite: no false alarm
    for step in (1, 2, 3, 4):
        guard.step_number = step
        if step == 3:
            weights[0][4] = NAN
        guard.note_weights(weights)
    assert guard.settle().bad_weights_step == 3
    assert guard.settle().bad_weights_step == 3  # the weights stay bad: said again


def test_stop_flags_are_agreed_on_the_host_without_a_device_read(guard):
    counter = HostSyncCounter()
    with counter:
        assert guard.agree_on_stop() is False
        guard.run_dir_deleted_here = True
        assert guard.agree_on_stop() is True and guard.run_dir_deleted
    assert counter.total() == 0
