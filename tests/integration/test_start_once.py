"""A run's start resolves the job's layout once (``topology.job_layout``) and asks the planner
once (``plan.fit.start_plan``: ``auto`` and the fit check from one plan), then hands both to
the engine, the loader, the evaluator and context parallelism."""

from __future__ import annotations

from collections import Counter

import pytest
from conftest import FAST

from yatrain.common import GIB
from yatrain.plan import fit, limits
from yatrain.plan.budget import MemoryBudget
from yatrain.plan.search import plan_memory
from yatrain.recipe import topology
from yatrain.recipe.load import load_recipe
from yatrain.recipe.topology import JobLayout, job_layout
from yatrain.train.loop import pretrain


def count_calls(monkeypatch, module, name: str, counts: Counter) -> None:
    original = getattr(module, name)

    def counted(*args, **kwargs):
        counts[name] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)


def planner_and_layout_calls(monkeypatch) -> Counter:
    counts: Counter = Counter()
    count_calls(monkeypatch, fit, "plan_for_layers", counts)  # one setting's whole plan
    count_calls(monkeypatch, fit, "plan_memory", counts)  # the search: the fewest that fit
    count_calls(monkeypatch, limits, "plan_memory", counts)  # the same search, for auto
    count_calls(monkeypatch, topology, "shard_group_size", counts)
    count_calls(monkeypatch, topology, "context_parallel", counts)
    return counts


@pytest.mark.parametrize("layers", ["1", "auto"])
def test_a_start_lays_the_job_out_once_and_plans_once(small_data, tmp_path, monkeypatch, layers):
    recipe = load_recipe(
        "recipes/tiny.yaml",
        [*FAST, f"data.path={small_data}", f"sharding.activation_checkpoint_layers={layers}"],
    )
    counts = planner_and_layout_calls(monkeypatch)
    pretrain(recipe, run_dir=tmp_path / "run", steps=1, progress=False)
    assert counts["plan_for_layers"] + counts["plan_memory"] == 1
    assert counts["shard_group_size"] == 1
    assert counts["context_parallel"] == 1


def test_on_a_gpu_one_plan_answers_auto_and_the_fit_check(monkeypatch):
    """A GPU's budget (what ``memory_budget`` makes on CUDA: the fit check asks what
    ``auto`` planned against): one whole plan, whose count is the one ``auto`` means."""
    recipe = load_recipe("recipes/llama3_8b.yaml", ["sharding.activation_checkpoint_layers=auto"])
    layout = JobLayout(world_size=64, shard_group=64, context=1, local_world_size=8)
    gpu = 79 * GIB
    budget = MemoryBudget(gpu, "H100", gpu, "H100", None, gpu)
    counts = planner_and_layout_calls(monkeypatch)
    said: list[str] = []
    layers = fit.start_plan(recipe, layout, budget, True, said.append)
    assert counts["plan_for_layers"] + counts["plan_memory"] == 1
    assert layers == plan_memory(recipe, 64, gpu).activation_checkpoint_layers
    assert said[0].startswith(f"sharding.activation_checkpoint_layers auto -> {layers} (H100)")


def test_the_layout_names_the_shard_group_replicas_and_data_ranks():
    recipe = load_recipe("recipes/llama3_1_8b_long.yaml", ["sharding.shard_group_size=auto"])
    layout = job_layout(recipe, world_size=16, local_world_size=8)
    cp = recipe.sharding.context_parallel
    assert (layout.shard_group, layout.replicas, layout.context) == (8, 2, cp)
    assert layout.data_ranks == 16 // cp
    assert [layout.data_rank(r) for r in range(16)] == [r // cp for r in range(16)]
