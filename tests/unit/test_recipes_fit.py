"""Every shipped recipe fits the hardware its header names, as shipped: the planner's answer
for the recipe's own setting there (for ``auto``, the count it resolves to), with no model
built. The README's recipe table and its first GPU command are checked against the same."""

from __future__ import annotations

import re
from dataclasses import replace as dataclass_replace

import pytest
from conftest import ROOT
from recipe_hardware import RECIPES, plan_there, stated_hardware

from yatrain.recipe.load import load_recipe

# A fixed layer count must leave this share of the memory free: the planner is an estimate.
ROOM_TO_SPARE = 0.05


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_each_recipe_fits_the_hardware_its_header_names(path):
    hardware = stated_hardware(path)
    assert hardware is not None, (
        f"{path.name} names no hardware: add a '# Hardware: N x 80 GB GPUs' header line"
    )
    recipe = load_recipe(path)
    plan = plan_there(recipe, hardware)
    own = plan.recipe_setting
    where = f"{path.name} on {hardware.words}"
    assert own["fits"], f"{where}: {own['resolved_layers']} layers need {own['peak_bytes_per_gpu']}"
    if own["activation_checkpoint_layers"] != "auto":
        limit = hardware.memory_gib * 2**30
        assert own["peak_bytes_per_gpu"] <= (1 - ROOM_TO_SPARE) * limit, f"{where}: no room"
    data_ranks = hardware.devices // recipe.sharding.context_parallel
    assert recipe.data.global_batch_size % (recipe.data.micro_batch_size * data_ranks) == 0


def test_an_old_layer_count_that_does_not_fit_fails_the_check():
    """Llama 3 70B with YaFSDP's 20 layers (measured at 2,048 tokens) at its 8,192: 205 GiB."""
    path = ROOT / "recipes" / "llama3_70b.yaml"
    old = load_recipe(path, ["sharding.activation_checkpoint_layers=20"])
    assert plan_there(old, stated_hardware(path)).recipe_setting["fits"] is False


def test_a_recipe_header_without_hardware_is_caught(tmp_path):
    bare = tmp_path / "r.yaml"
    bare.write_text("# Llama without a cluster\nmodel: {}\n")
    assert stated_hardware(bare) is None


def readme_rows() -> dict[str, list[str]]:
    text = (ROOT / "README.md").read_text()
    rows = {}
    for line in text.splitlines():
        if match := re.match(r"\| `recipes/([\w.]+)\.yaml` \|(.*)\|$", line):
            rows[match.group(1)] = [cell.strip() for cell in match.group(2).split("|")]
    return rows


def test_the_readme_recipe_table_matches_the_recipes_and_the_planner():
    rows = readme_rows()
    assert sorted(rows) == sorted(p.stem for p in RECIPES)
    for path in RECIPES:
        recipe, hardware = load_recipe(path), stated_hardware(path)
        _, _, seq, micro, words, layers, fewest = rows[path.stem]
        plan = plan_there(recipe, hardware)
        expected = [
            str(recipe.data.seq_len),
            str(recipe.data.micro_batch_size),
            hardware.words,
            str(recipe.sharding.activation_checkpoint_layers),
            str(plan.activation_checkpoint_layers),
        ]
        assert [seq, micro, words, layers, fewest] == expected, path.name


def test_the_readme_first_gpu_command_fits_as_shipped():
    text = (ROOT / "README.md").read_text()
    match = re.search(r"yatrain pretrain recipes/(\w+)\.yaml --nproc-per-node (\d+)", text)
    assert match, "README shows no GPU command"
    path = ROOT / "recipes" / f"{match.group(1)}.yaml"
    hardware = stated_hardware(path)
    gpus = dataclass_replace(hardware, devices=int(match.group(2)))
    assert plan_there(load_recipe(path), gpus).recipe_setting["fits"]
