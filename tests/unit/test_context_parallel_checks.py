"""sharding.context_parallel: what a recipe or a launch cannot do is one line naming the key
and the fix (a window not cut into 2 x CP equal chunks, CP not dividing the world or the
shard group, a batch that does not split over the data ranks, CP on one process)."""

from __future__ import annotations

import pytest
import yaml
from conftest import ROOT

from yatrain.errors import ConfigError
from yatrain.recipe.load import load_recipe, recipe_from_dict
from yatrain.recipe.topology import context_parallel, shard_group_size, validate_world_size

TINY = ROOT / "recipes" / "tiny.yaml"  # seq_len 128, micro 8, global 16


def recipe(*overrides: str):
    return load_recipe(TINY, overrides)


def refusal(call, *args) -> str:
    with pytest.raises(ConfigError) as caught:
        call(*args)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_default_is_one_and_every_layout_that_fits_is_accepted():
    assert recipe().sharding.context_parallel == 1
    assert context_parallel(recipe(), 3) == 1
    cp = recipe("sharding.context_parallel=2", "data.global_batch_size=16")
    validate_world_size(cp, 4)  # 2 data ranks x micro 8 = 16
    assert context_parallel(cp, 4) == 2
    hybrid = recipe("sharding.context_parallel=2", "sharding.shard_group_size=2")
    assert shard_group_size(hybrid, 4, 2) == 2


def test_sequence_not_cut_into_2_x_cp_chunks():
    raw = yaml.safe_load(TINY.read_text())
    raw["sharding"]["context_parallel"] = 3  # 128 tokens, 6 chunks
    message = refusal(recipe_from_dict, raw)
    assert (
        "'data.seq_len' (128) is not a multiple of 2 x 'sharding.context_parallel' = 6" in message
    )
    assert "use e.g. 132" in message


def test_cp_not_dividing_the_world():
    message = refusal(validate_world_size, recipe("sharding.context_parallel=4"), 6)
    assert "'sharding.context_parallel' 4 does not divide the world size (6)" in message
    assert "one of 1, 2, 3, 6" in message


def test_cp_not_dividing_the_shard_group():
    hybrid = recipe("sharding.context_parallel=4", "sharding.shard_group_size=2")
    message = refusal(shard_group_size, hybrid, 8, 2)
    assert "'sharding.context_parallel' 4 does not divide the shard group of 2 ranks" in message
    whole = recipe("sharding.context_parallel=4")  # the shard group is the world: its line
    assert "does not divide the world size (6)" in refusal(shard_group_size, whole, 6, 6)


def test_batch_not_split_over_the_data_ranks():
    cp = recipe("sharding.context_parallel=2", "data.global_batch_size=24")
    validate_world_size(cp, 2)  # one data rank: 24 = 3 x 8
    message = refusal(validate_world_size, cp, 4)  # two data ranks: 16 a step
    assert "x data ranks (world size 4 / sharding.context_parallel 2) = 16" in message
    assert "such as 16 or 32" in message


def test_cp_on_one_process():
    forced = recipe("sharding.context_parallel=2", "sharding.force_process_group=true")
    message = refusal(validate_world_size, forced, 1)
    assert "sharding.force_process_group runs one rank" in message
    assert "--nproc-per-node 2" in message
