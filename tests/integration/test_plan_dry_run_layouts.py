"""``yatrain plan --dry-run`` over the layouts beside full sharding (hybrid sharding's 2-D mesh,
context parallelism's groups) on the fake process group, and the table of every shipped
recipe's dry run (``scripts/dry_run_table.py``, docs/planner.md)."""

from __future__ import annotations

import json

import pytest
from conftest import ROOT
from dry_run_table import OUT, flag_value, header_flags, recipes, table
from test_failures import yatrain

TINY = str(ROOT / "recipes" / "tiny.yaml")
WORLD_8 = ["--gpus", "8", "--gpu-memory", "80", "--dry-run", "--json"]


def tiny_dry_run(env: dict, *flags: str) -> dict:
    """The tiny recipe as rank 0 of 8, two micro-batches a step whatever the layout."""
    result = yatrain("plan", TINY, *WORLD_8, *flags, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def within_one_percent(out: dict) -> bool:
    planned = out["planned_peak_bytes"]
    return abs(out["tracked_peak_bytes"] - planned) <= 0.01 * planned


def test_hybrid_sharding_runs_on_the_fake_group(isolated_env):
    """Shard groups of 4 replicated twice: the mesh is built over fake ranks, the replicas'
    all-reduce runs each step, and the peak is the planner's for a shard group of 4."""
    full = tiny_dry_run(isolated_env, "--set", "data.global_batch_size=128")
    hybrid = tiny_dry_run(
        isolated_env, "--shard-group-size", "4", "--set", "data.global_batch_size=128"
    )
    assert within_one_percent(hybrid), hybrid
    assert hybrid["planned_peak_bytes"] > full["planned_peak_bytes"]  # 1/4 of the state, not 1/8
    assert hybrid["collectives"]["all_reduce"]["count"] > full["collectives"]["all_reduce"]["count"]


def test_context_parallelism_runs_on_the_fake_group(isolated_env):
    """CP 2: each rank runs its half of every window (the activations halve), its K/V
    collectives over a CP group of the fake world, and the peak is the plan's."""
    whole = tiny_dry_run(isolated_env, "--set", "data.global_batch_size=128")
    halves = tiny_dry_run(
        isolated_env, "--context-parallel", "2", "--set", "data.global_batch_size=64"
    )
    assert within_one_percent(halves), halves
    assert halves["tracked_peak_bytes"] < whole["tracked_peak_bytes"]


@pytest.mark.parametrize("recipe", recipes([]), ids=lambda path: path.stem)
def test_every_recipe_header_names_its_cluster(recipe):
    flags = header_flags(recipe)
    assert int(flag_value(flags, "--gpus")) >= 1
    assert float(flag_value(flags, "--gpu-memory")) > 0


def test_a_header_without_its_own_plan_line_is_refused(tmp_path):
    other = tmp_path / "mine.yaml"
    other.write_text("# A recipe.\n#   yatrain plan recipes/tiny.yaml --gpus 8\nmodel: {}\n")
    with pytest.raises(ValueError, match="not itself"):
        header_flags(other)
    later = tmp_path / "later.yaml"
    later.write_text("# A recipe.\nmodel: {}\n#   yatrain plan recipes/later.yaml --gpus 8\n")
    with pytest.raises(ValueError, match="no 'yatrain plan"):
        header_flags(later)
    assert flag_value(["--gpus=16", "--gpu-memory", "79"], "--gpus") == "16"


def test_the_saved_table_covers_every_recipe_at_its_header():
    """docs/data/dry_runs.json (the table in docs/planner.md) holds one finished dry run of
    each shipped recipe, made with its header's flags as they are now."""
    saved = {r["recipe"]: r for r in json.loads(OUT.read_text())}
    for recipe in recipes([]):
        result = saved[recipe.name]
        assert "error" not in result, result
        assert result["command"].split(" --dry-run")[0].endswith(" ".join(header_flags(recipe)))
    assert table(list(saved.values())).count("\n") == len(saved) + 1
