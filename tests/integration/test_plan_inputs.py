"""The planner and the sweep against hostile and careless inputs (issue 43): a recipe that
already runs context parallel, absurd GPU counts and memories, digits ``int`` cannot read,
huge worlds; each answer is a plan or one line, at once."""

from __future__ import annotations

import pytest
from conftest import FAST, ROOT
from typer.testing import CliRunner

from yatrain.cli import app
from yatrain.errors import ConfigError
from yatrain.recipe_load import load_recipe
from yatrain.sweep.configs import expand_configs

TINY = ROOT / "recipes/tiny.yaml"


def test_a_recipe_that_runs_context_parallel_can_be_swept():
    """The sweep's probe of the recipe used data.seq_len=1, which CP 2 refuses."""
    sets = [*FAST, "sharding.context_parallel=2"]
    configs = expand_configs(TINY, sets, [32, 64], ["0"], 3, 2, False)
    assert [(c.seq_len, c.context_parallel) for c in configs] == [(32, 2), (64, 2)]


def test_a_reduce_staging_budget_of_bytes_is_refused_in_one_line():
    """1e-9 MiB reduced each gradient a column at a time: step 1 never ended, and plan
    printed millions of reduce-scatters per unit without a word."""
    result = CliRunner().invoke(
        app, ["plan", str(TINY), "--gpus", "8", "--set", "sharding.reduce_staging_mib=1e-9"]
    )
    assert result.exit_code != 0
    assert "'sharding.reduce_staging_mib' (1e-09) is below 1 MiB" in str(result.exception)
    with pytest.raises(ConfigError, match="set it to 1 or more, or auto"):
        load_recipe(TINY, ["sharding.reduce_staging_mib=0.999"])
    assert load_recipe(TINY, ["sharding.reduce_staging_mib=1"]).sharding.reduce_staging_mib == 1
