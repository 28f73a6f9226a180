"""Checkpoints do not depend on the sharding layout: a run saved under hybrid sharding (2 x 2)
resumes under full sharding at 2 and 4 ranks, and one saved under full sharding resumes under
2 x 2, each continuing the uninterrupted single-process trajectory. Each shard is saved once
with its global offset (the replicas hold the same data; DCP writes it from one of them)."""

from __future__ import annotations

import json

import pytest
from conftest import ROOT
from distributed import run_ranks
from test_checkpoint import (  # noqa: F401 (uninterrupted: a fixture)
    _train_on_ranks,
    assert_same_trajectory,
    losses,
    train,
    uninterrupted,
)

from yatrain.checkpoint import store as ckpt
from yatrain.errors import ConfigError
from yatrain.recipe.load import load_recipe
from yatrain.recipe.topology import shard_group_size

HYBRID = ("sharding.shard_group_size=2",)


@pytest.mark.parametrize(
    "first,second",
    [
        ((4, HYBRID), (2, ())),
        ((4, HYBRID), (4, ())),
        ((4, ()), (4, HYBRID)),
        ((4, (*HYBRID, "checkpoint.async=true")), (2, ())),
    ],
    ids=["2x2-to-full2", "2x2-to-full4", "full4-to-2x2", "2x2-async-to-full2"],
)
def test_layouts_resume_each_others_checkpoints(small_data, uninterrupted, tmp_path, first, second):  # noqa: F811
    run_dir = tmp_path / "run"
    for (world, extra), steps in ((first, 4), (second, 8)):
        run_ranks(world, _train_on_ranks, small_data, run_dir, steps, extra)
    manifest = json.loads((run_dir / "checkpoints/step-4" / ckpt.MANIFEST).read_text())
    assert manifest["world_size_at_save"] == first[0]
    assert_same_trajectory(losses(run_dir), uninterrupted)


def test_shard_group_that_does_not_divide_the_world_is_one_line(small_data, tmp_path):
    with pytest.raises(ConfigError, match="shard_group_size' 3 does not divide") as error:
        train(small_data, tmp_path / "run", 2, "sharding.shard_group_size=3")
    assert "\n" not in str(error.value) and "set it to 1" in str(error.value)


@pytest.mark.parametrize(
    "value,world,local,want",
    [(None, 8, 4, 8), ("auto", 8, 4, 4), (2, 8, 4, 2), (1, 3, 3, 1), ("auto", 6, 4, None)],
)
def test_shard_group_size_resolution(small_data, value, world, local, want):
    cfg = load_recipe(ROOT / "recipes/tiny.yaml", [f"data.path={small_data}"])
    cfg.sharding.shard_group_size = value
    if want is None:
        with pytest.raises(ConfigError, match=r"auto \(auto: 4 ranks per node\)"):
            shard_group_size(cfg, world, local)
    else:
        assert shard_group_size(cfg, world, local) == want
