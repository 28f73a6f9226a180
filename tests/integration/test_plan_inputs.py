"""The planner and the sweep against hostile and careless inputs (issue 43): a recipe that
already runs context parallel, absurd GPU counts and memories, digits ``int`` cannot read,
huge worlds; each answer is a plan or one line, at once."""

from __future__ import annotations

from conftest import FAST, ROOT

from yatrain.sweep.configs import expand_configs

TINY = ROOT / "recipes/tiny.yaml"


def test_a_recipe_that_runs_context_parallel_can_be_swept():
    """The sweep's probe of the recipe used data.seq_len=1, which CP 2 refuses."""
    sets = [*FAST, "sharding.context_parallel=2"]
    configs = expand_configs(TINY, sets, [32, 64], ["0"], 3, 2, False)
    assert [(c.seq_len, c.context_parallel) for c in configs] == [(32, 2), (64, 2)]
