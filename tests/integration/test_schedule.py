"""optim.schedule: cosine (the default, unchanged), wsd and constant."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from conftest import FAST, ROOT

from yatrain.errors import ConfigError
from yatrain.recipe.config import OptimConfig
from yatrain.recipe.load import load_recipe
from yatrain.train.loop import pretrain
from yatrain.train.schedule import lr_at

BASE = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=10)


def lrs(total: int, **changes) -> list[float]:
    optim = dataclasses.replace(BASE, **changes)
    return [lr_at(step, optim, total) for step in range(1, total + 1)]


def test_cosine_is_the_default_and_unchanged():
    """The formula yatrain always used: warm-up, then min_lr + (lr - min_lr)(1 + cos)/2."""
    assert OptimConfig(lr=1.0).schedule == "cosine"
    got = lrs(110)
    assert got[:10] == [pytest.approx(s / 10) for s in range(1, 11)]
    for step in range(11, 111):
        progress = (step - 10) / 100
        want = 0.1 + 0.45 * (1 + math.cos(math.pi * progress))
        assert got[step - 1] == pytest.approx(want)
    assert got[-1] == pytest.approx(0.1)


@pytest.mark.parametrize(
    "shape,mid",
    [("linear", 0.55), ("sqrt", 0.1 + 0.9 * (1 - math.sqrt(0.5))), ("cosine", 0.55)],
)
def test_wsd_is_stable_then_decays_over_the_last_fraction(shape, mid):
    got = lrs(110, schedule="wsd", decay_fraction=0.2, decay_shape=shape)  # decay: 22 steps
    assert got[9] == 1.0  # end of warm-up
    assert all(lr == 1.0 for lr in got[10:88])  # stable until step 88
    assert got[88 + 11 - 1] == pytest.approx(mid)  # half-way through the decay
    assert got[-1] == pytest.approx(0.1)  # min_lr at the last step
    assert all(a >= b for a, b in zip(got[87:], got[88:], strict=False))  # never rises


def test_wsd_sqrt_drops_faster_than_linear_early_in_the_decay():
    linear = lrs(110, schedule="wsd", decay_shape="linear")
    sqrt = lrs(110, schedule="wsd", decay_shape="sqrt")
    assert sqrt[90] < linear[90]


def test_constant_holds_lr_after_warm_up_and_zero_warm_up_starts_at_lr():
    assert lrs(50, schedule="constant")[10:] == [1.0] * 40
    assert lrs(5, schedule="constant", warmup_steps=0) == [1.0] * 5
    assert lrs(5, warmup_steps=0)[0] == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi / 5)))


def test_a_longer_run_on_resume_moves_the_wsd_decay_to_its_new_end():
    """Resumed at step 80 of 100 with train.steps raised to 200: still stable at lr, and
    the decay now spans the last 40 of 200 steps."""
    optim = dataclasses.replace(BASE, schedule="wsd")
    assert lr_at(80, optim, 100) == 1.0 and lr_at(90, optim, 100) < 1.0
    assert lr_at(90, optim, 200) == 1.0 and lr_at(160, optim, 200) == 1.0
    assert lr_at(161, optim, 200) < 1.0 and lr_at(200, optim, 200) == pytest.approx(0.1)


def test_schedule_keys_are_checked():
    recipe = load_recipe(
        ROOT / "recipes/tiny.yaml",
        [*FAST, "data.path=x", "optim.schedule=wsd", "optim.decay_shape=sqrt"],
    )
    assert (recipe.optim.schedule, recipe.optim.decay_fraction) == ("wsd", 0.2)
    with pytest.raises(ConfigError, match="optim.schedule"):
        load_recipe(ROOT / "recipes/tiny.yaml", [*FAST, "data.path=x", "optim.schedule=step"])
    with pytest.raises(ConfigError, match="optim.decay_fraction"):
        load_recipe(ROOT / "recipes/tiny.yaml", [*FAST, "data.path=x", "optim.decay_fraction=0"])


def test_resuming_a_wsd_run_with_more_steps_continues_at_lr(small_data, tmp_path):
    """4 steps (decay at step 4), then resumed with train.steps=8: steps 5-6 at lr, the
    decay over 7-8, as the docs say; each step logs the LR it used."""
    overrides = [
        *FAST,
        *(f"data.path={small_data}", "optim.schedule=wsd", "optim.warmup_steps=0"),
        *("optim.decay_fraction=0.25", "checkpoint.every=2"),
    ]
    cfg = load_recipe(ROOT / "recipes/tiny.yaml", overrides)
    pretrain(cfg, run_dir=tmp_path / "run", steps=4, progress=False)
    pretrain(cfg, run_dir=tmp_path / "run", steps=8, resume="auto", progress=False)
    lines = (tmp_path / "run/metrics.jsonl").read_text().splitlines()
    lr = {r["step"]: r["lr"] for r in map(json.loads, lines) if "lr" in r}
    peak, floor = cfg.optim.lr, cfg.optim.min_lr
    assert [lr[s] for s in (1, 2, 3, 5, 6)] == [pytest.approx(peak)] * 5
    assert lr[4] == pytest.approx(floor) and lr[8] == pytest.approx(floor)
    assert floor < lr[7] < peak
