"""``logging.tensorboard``: the records' fields as TensorBoard scalars, and one error line
when the optional package is missing."""

from __future__ import annotations

import importlib.util

import pytest
from conftest import FAST, ROOT

from yatrain.errors import ConfigError
from yatrain.output import tensorboard_logger
from yatrain.output.record import read_metrics
from yatrain.recipe.load import load_recipe
from yatrain.train.loop import pretrain

pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402


def test_tensorboard_gets_every_field_of_every_record(small_data, tmp_path):
    overrides = [*FAST, f"data.path={small_data}", "logging.tensorboard=true"]
    recipe = load_recipe(ROOT / "recipes/tiny.yaml", overrides)
    summary = pretrain(recipe, run_dir=tmp_path / "run", steps=3, progress=False)
    events = EventAccumulator(str(tmp_path / "run/tensorboard"))
    events.Reload()
    records = read_metrics(tmp_path / "run/metrics.jsonl")
    for name in ("loss", "mfu", "compute_s", "comm_exposed_s", "median_busy_s", "lr"):
        logged = events.Scalars(name)
        assert [e.step for e in logged] == [r.step for r in records]
        assert [e.value for e in logged] == pytest.approx([getattr(r, name) for r in records])
    final = events.Scalars("summary/final_loss")
    assert [(e.step, e.value) for e in final] == [(3, pytest.approx(summary["final_loss"]))]
    assert "val_loss" not in events.Tags()["scalars"]  # no evaluation: nothing invented


def test_tensorboard_without_the_package_is_one_error(small_data, tmp_path, monkeypatch):
    real = importlib.util.find_spec
    missing = lambda name, *a: None if name == "tensorboard" else real(name, *a)  # noqa: E731
    monkeypatch.setattr(importlib.util, "find_spec", missing)
    overrides = [*FAST, f"data.path={small_data}", "logging.tensorboard=true"]
    recipe = load_recipe(ROOT / "recipes/tiny.yaml", overrides)
    with pytest.raises(ConfigError, match=r"pip install 'yatrain\[tensorboard\]'"):
        tensorboard_logger.require_tensorboard(recipe)
    with pytest.raises(ConfigError, match="tensorboard package is not installed"):
        pretrain(recipe, run_dir=tmp_path / "run", steps=1, progress=False)
    assert not (tmp_path / "run").exists()
