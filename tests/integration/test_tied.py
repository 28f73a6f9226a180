"""Tied embeddings (Llama 3.2): one weight serves the embedding and the output head, in the
model and in the engine, which trains it exactly like a plain tied model."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import PLANNER_TOLERANCE
from distributed import run_ranks
from engine_reference import (
    CFG,
    SEED,
    batches,
    engine_for,
    max_rel,
    reference,
    run_steps,
    weights_rel,
)
from test_plan import _measure, _warm_tracker, planned, small_recipe  # noqa: F401 (autouse fixture: warms the tracker)

from yatrain.models.llama import build_model, count_parameters, flops_per_token, materialize
from yatrain.plan.memory import engine_state_bytes
from yatrain.sharding.groups import hybrid_mesh

TIED = dataclasses.replace(CFG, tie_embeddings=True)


def train_tied(rank, world, data, micro, clip, hybrid=False, dtype=torch.float32):
    model = build_model(TIED)
    mesh = hybrid_mesh("cpu", 2) if hybrid else None
    engine = engine_for(model, mesh=mesh, param_dtype=dtype)
    losses, norms = run_steps(model, engine, rank, world, data, micro, clip)
    keys = [entry.key for entry in engine.state_layout]
    return losses, norms, engine.full_state_dict(), keys, len(engine.param_groups(0.1)[0]["params"])


@pytest.mark.parametrize(
    "world,global_batch,micro,clip,hybrid",
    [
        (1, 4, 2, 0.5, False),  # the direct path, two micro-batches
        (2, 4, 1, 0.0, False),  # both uses reduce-scattered into one shard, accumulated
        (3, 6, 2, 0.5, False),  # padding
        (4, 8, 1, 0.0, True),  # hybrid: the tied shard is all-reduced across replicas once
    ],
)
def test_tied_engine_matches_a_plain_tied_model(world, global_batch, micro, clip, hybrid):
    data = batches(global_batch, steps=6)
    want_losses, want_norms, want_weights = reference(data, clip, cfg=TIED)
    args = (data, micro, clip, hybrid)
    results = [train_tied(0, 1, *args)] if world == 1 else run_ranks(world, train_tied, *args)
    losses, norms, weights, keys, n_params = results[0]
    assert "output.weight" not in weights  # saved once, as the embedding
    assert max_rel(losses, want_losses) < 1e-5
    assert max_rel(norms, want_norms) < 1e-5
    assert weights_rel(weights, want_weights) < 1e-5
    assert keys == [f"unit.{i}" for i in range(TIED.n_layers + 1)] + ["small"]
    assert n_params == TIED.n_layers + 1  # the optimizer steps the shared shard once


@pytest.mark.parametrize("world", [1, 2])
def test_tied_engine_in_bf16_stays_close_to_the_fp32_reference(world):
    """bf16 weights (the one-process compute copy at world 1, bf16 gathers at 2): losses
    within 0.5% and gradient norms within 2% of fp32, as untied models (test_engine)."""
    data = batches(4, steps=6)
    want_losses, want_norms, _ = reference(data, 0.0, cfg=TIED)
    args = (data, 1, 0.0, False, torch.bfloat16)
    results = [train_tied(0, 1, *args)] if world == 1 else run_ranks(world, train_tied, *args)
    losses, norms = results[0][:2]
    assert max_rel(losses, want_losses) < 5e-3
    assert max_rel(norms, want_norms) < 2e-2


def test_tied_model_shares_one_parameter_and_counts_it_once():
    model = materialize(build_model(TIED), "cpu", SEED)
    assert model.output.weight is model.tok_embeddings.weight
    assert sum(p.numel() for p in model.parameters()) == count_parameters(TIED)
    table = TIED.vocab_size * TIED.dim
    assert count_parameters(CFG) - count_parameters(TIED) == table
    # The head's matmul is work whether or not its weight is the embedding's.
    assert flops_per_token(TIED, 12) == flops_per_token(CFG, 12)
    tied, untied = (engine_state_bytes(c, 2, "bf16", "fp32", 1) for c in (TIED, CFG))
    assert untied["master_weights"] - tied["master_weights"] == 4 * table // 2
    assert untied["optimizer_state"] - tied["optimizer_state"] == 8 * table // 2


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_planner_matches_measured_memory_of_a_tied_model(dtype):
    """The shared weight's state counted once: resident state and step peak within the
    planner's tolerance of the live-tensor count at world size 2."""
    rec = small_recipe(dtype, 0)
    rec.model.tie_embeddings = True
    resident, step_peak = run_ranks(2, _measure, rec)[0]
    planned_resident, planned_step, _ = planned(rec, 2, 0)
    assert planned_resident == pytest.approx(resident, rel=PLANNER_TOLERANCE)
    assert planned_step == pytest.approx(step_peak, rel=PLANNER_TOLERANCE)
