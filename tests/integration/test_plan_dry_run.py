"""``yatrain plan --dry-run``: the real engine and loop as one rank of a fake world, on fake
tensors, held against the planner; its collectives equal a real gloo run's; a planner that
forgets a term is caught."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing

import pytest
import torch
import torch.distributed as dist
from conftest import ROOT
from distributed import run_ranks
from test_failures import one_line_error, yatrain

from yatrain.dry_run import run as dry_run_module
from yatrain.dry_run.categories import (
    ACTIVATIONS,
    CATEGORIES,
    GATHER,
    HEAD,
    NOT_TENSORS,
    PLANNED,
    moment_name,
)
from yatrain.dry_run.run import KINDS, dry_run, for_dry_run
from yatrain.plan import plan_for_layers
from yatrain.recipe.load import load_recipe
from yatrain.runtime.process import Runtime
from yatrain.train.build import build_model_and_engine
from yatrain.train.optim import run_optimizer
from yatrain.train.step import train_step

TINY = str(ROOT / "recipes" / "tiny.yaml")
GIB = 2**30


def test_the_tiny_recipe_at_world_64_through_the_cli(isolated_env):
    """The CI run: rank 0 of 64 (a global batch that lays out at 64), JSON on stdout, the
    tracked peak within 1% of the plan, in total and in every category (which add up to the
    totals on both sides), and nothing written where it ran."""
    args = ["plan", TINY, "--gpus", "64", "--gpu-memory", "80", "--dry-run", "--json"]
    result = yatrain(*args, "--set", "data.global_batch_size=512", env=isolated_env)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout)
    assert (out["recipe"], out["world_size"], out["rank"], out["fits"]) == (
        "tiny.yaml",
        64,
        0,
        True,
    )
    diff = out["tracked_peak_bytes"] - out["planned_peak_bytes"]
    assert abs(diff) < 0.01 * out["planned_peak_bytes"]
    categories = out["categories"]
    assert list(categories) == list(CATEGORIES)
    for side in ("tracked", "planned"):
        total = sum(c[f"{side}_bytes"] for c in categories.values())
        assert total == out[f"{side}_peak_bytes"]
    for name, c in categories.items():
        assert c["difference_bytes"] == c["tracked_bytes"] - c["planned_bytes"]
        assert abs(c["difference_bytes"]) <= 0.01 * c["planned_bytes"] + 1024, name
    assert out["seconds"] > 0 and out["collectives"]["all_gather"]["count"] > 0
    assert "loss n/a" in result.stderr and "gnorm n/a" in result.stderr


def test_the_report_in_words(isolated_env):
    args = ["plan", TINY, "--gpus", "8", "--gpu-memory", "0.05", "--runtime-allowance", "0"]
    result = yatrain(*args, "--dry-run", "--set", "data.global_batch_size=64", env=isolated_env)
    assert result.returncode == 0, result.stderr[-3000:]
    for needle in (
        "rank 0 of 8",
        "tracked (live tensors)",
        "planned (at",
        "by category: tracked peak at loss, planned at loss",
        "gather buffers",
        "head and loss",
        "does NOT fit",
        "reduce-scatter",
        "attention kernel",
        "eager",
    ):
        assert needle in result.stdout, result.stdout


def test_bad_input_is_one_line(isolated_env, tmp_path):
    env = isolated_env
    one_line_error(yatrain("plan", TINY, "--dry-run", env=env), "--gpus")
    one_line_error(yatrain("plan", TINY, "--gpus", "3", "--dry-run", env=env), "--gpus")
    one_line_error(
        yatrain("plan", str(tmp_path / "none.yaml"), "--gpus", "2", "--dry-run", env=env)
    )
    one_line_error(
        yatrain("plan", TINY, "--gpus", "2", "--dry-run", "--set", "model.nope=1", env=env)
    )
    one_line_error(
        yatrain("plan", TINY, "--gpus", "2", "--rank", "2", "--dry-run", env=env), "--rank"
    )


PINNED = ["sharding.reduce_staging_mib=1"]  # each decoder unit in 3 or 4 pieces (the plan's)


def _gloo_rank(rank, world):
    """Two real gloo ranks, the same recipe and build: the engine's collectives of step 2."""
    recipe = for_dry_run(load_recipe(TINY, PINNED), 2)
    runtime = Runtime(rank, world, rank, torch.device("cpu"))
    model, engine = build_model_and_engine(recipe, runtime, staging_of=80 * GIB)
    optimizer = run_optimizer(engine, model, recipe.optim)
    d = recipe.data
    per_rank = d.global_batch_size // (d.micro_batch_size * world)
    batch = [(torch.zeros(d.micro_batch_size, d.seq_len, dtype=torch.int64),) * 2] * per_rank
    train_step(model, engine, optimizer, batch, grad_clip=1.0)
    before = engine.traffic()
    train_step(model, engine, optimizer, batch, grad_clip=1.0)
    after = engine.traffic()
    return {
        k: {"count": after[k][0] - before[k][0], "bytes": after[k][1] - before[k][1]} for k in KINDS
    }


def test_a_world_2_dry_run_sends_what_two_gloo_ranks_send():
    recipe = load_recipe(TINY, PINNED)
    plan = dry_run_module.planned(recipe, 2, 80 * GIB, None)
    assert min(plan.staging["pieces"][1:-1]) >= 3  # the decoder units are cut
    fake = dry_run(recipe, "tiny.yaml", 2, gpu_memory=80 * GIB).collectives
    assert not dist.is_initialized()
    real = run_ranks(2, _gloo_rank)
    assert real[0] == real[1] == fake


def _forgetful_dry_run(queue, term_name):
    """A dry run at world 8 whose planner leaves ``term_name`` out (in a fresh process: a
    dry run's last step counts every tensor alive in its process)."""
    planner = dry_run_module.plan_for_layers

    def forgetful(*args, **kwargs):
        plan = planner(*args, **kwargs)
        term = plan.breakdown[term_name]
        breakdown = {k: v for k, v in plan.breakdown.items() if k != term_name}
        return dataclasses.replace(
            plan, breakdown=breakdown, tensor_peak_bytes=plan.tensor_peak_bytes - term
        )

    dry_run_module.plan_for_layers = forgetful
    recipe = load_recipe(TINY, ["data.global_batch_size=64"])
    run = dry_run(recipe, "tiny.yaml", 8, gpu_memory=80 * GIB)
    queue.put((run.tracked_peak_bytes, run.planned_peak_bytes, run.categories()))


@pytest.mark.parametrize(
    "term_name, category", [("head_gradient", HEAD), ("gather_buffers", GATHER)]
)
def test_a_planner_that_forgets_a_term_is_caught(term_name, category):
    """A term (over 1% of the tiny model's peak at world 8) left out of the plan: the dry
    run reports a difference of that term's bytes, in total (within 0.1% of the peak: as
    closely as the whole plan agrees with the run) and in the term's category (within 1% of
    the term), and every other category still agrees within 1% of the peak."""
    recipe = load_recipe(TINY, ["data.global_batch_size=64"])
    plan = dry_run_module.planned(for_dry_run(recipe, 2), 8, 80 * GIB, None)
    term = plan.breakdown[term_name]
    assert term > 0.01 * plan.tensor_peak_bytes
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_forgetful_dry_run, args=(queue, term_name))
    child.start()
    tracked, planned, categories = queue.get(timeout=120)
    child.join()
    assert planned == plan.tensor_peak_bytes - term
    assert abs(tracked - planned - term) <= 0.001 * plan.tensor_peak_bytes, tracked - planned
    missed = categories[category]["difference_bytes"]
    assert abs(missed - term) <= 0.01 * term, (missed, term)
    others = {k: c["difference_bytes"] for k, c in categories.items() if k != category}
    assert all(abs(d) <= 0.01 * plan.tensor_peak_bytes for d in others.values()), others


@pytest.mark.parametrize(
    "settings, world",
    [
        ([], 8),
        (["data.document_mask=true"], 8),
        (["sharding.context_parallel=2"], 8),
        (["train.dtype=bf16"], 1),  # one process: the bf16 compute copy
    ],
)
def test_every_planner_term_has_a_category(settings, world):
    """The planner's terms map to the dry run's categories, whichever the recipe uses, and
    the categories add up to the planned tensor peak."""
    recipe = load_recipe(TINY, ["data.global_batch_size=64", *settings])
    plan = plan_for_layers(recipe, world, 1)
    assert set(plan.breakdown) - NOT_TENSORS <= set(PLANNED)
    assert set(PLANNED.values()) <= set(CATEGORIES)
    planned = dry_run_module.side_by_side({}, plan.breakdown)
    assert sum(c["planned_bytes"] for c in planned.values()) == plan.tensor_peak_bytes


def test_the_tracked_moment_is_named_as_the_planner_names_its_moments():
    """Where the engine stood at the peak (phase, unit, its phase, micro-batch, of how many,
    module category, optimizer stepping), for 4 layers (6 units) with the first 2 checkpointed."""
    cases = {
        ("forward", 5, "forward", 1, 1, HEAD): "loss",
        ("forward", 3, "forward", 2, 2, ACTIVATIONS): "forward of layer 2, micro-batch 2 of 2",
        ("backward", 4, "backward", 1, 1, ACTIVATIONS): "backward of layer 3",
        ("backward", 2, "backward", 1, 1, ACTIVATIONS): "recompute of layer 1",
        ("backward", 5, "backward", 1, 1, HEAD): "backward of the head",
        ("backward", 0, "backward", 1, 1, ACTIVATIONS): "backward of the embedding",
        ("backward", 0, "done", 1, 1, ACTIVATIONS): "gradient norm",
        ("idle", None, None, 0, None, ACTIVATIONS): "between steps",
    }
    cases = {(*where, False): name for where, name in cases.items()}
    cases[("backward", 0, "done", 1, 1, ACTIVATIONS, True)] = "optimizer step"
    assert {where: moment_name(where, 6, 2) for where in cases} == cases
