"""Hybrid sharding (HSDP) trains exactly like a single process, and like full sharding.

Ranks form shard groups of G (a 2-D mesh, replicas x G); each group shards every unit among
its own ranks, and the groups all-reduce their gradient shards once per step. The fp32
losses, the pre-clip gradient norm of every step and the final weights must match the plain
single-process reference (tests/unit/test_engine.py) within 1e-5, with gradient accumulation,
clipping and activation checkpointing.
"""

from __future__ import annotations

import pytest
from distributed import run_ranks
from engine_reference import (
    CFG,
    TRAINED_MARGIN,
    batches,
    engine_for,
    max_rel,
    optimizer_for,
    planned_traffic,
    reference,
    train_sharded,
    untrained,
    weights_rel,
)

from yatrain.models.llama import build_model
from yatrain.sharding import ShardedEngine
from yatrain.sharding.groups import hybrid_mesh
from yatrain.train.step import train_step


def _train_hybrid(rank, world, group_size, data, micro, clip, ckpt, force, late=False):
    if late:  # this rank process only: the step does not say how many micro-batches it runs
        ShardedEngine.expect_micro_batches = lambda engine, count: None
    mesh = hybrid_mesh("cpu", group_size)
    losses, norms, weights = train_sharded(
        rank, world, data, micro, clip, ckpt, mesh=mesh, force_process_group=force
    )
    engine_sizes = (mesh.size(0), mesh.size(1))
    return losses, norms, weights, engine_sizes


@pytest.mark.parametrize(
    "world,group,global_batch,micro,clip,ckpt,late",
    [
        (4, 2, 8, 1, 0.5, 1, False),  # 2 x 2: accumulation x2, clipping, first layer checkpointed
        (6, 3, 12, 1, 0.5, 3, False),  # 2 replicas of 3: padding (sizes do not divide by 3)
        (6, 2, 12, 1, 0.0, 1, False),  # 3 replicas of 2, no clipping: weights see the scale
        (4, 1, 8, 2, 0.5, 1, False),  # groups of one: pure replication (DDP-like)
        (4, -1, 8, 2, 0.5, 1, False),  # groups of one on their one-rank process groups (buffers)
        (4, 2, 8, 1, 0.5, 1, True),  # 2 x 2, every all-reduce left to reduce_gradients
    ],
)
def test_hybrid_matches_single_process_reference(
    world, group, global_batch, micro, clip, ckpt, late
):
    """By default the step's last backward starts each unit's all-reduce across replicas as
    its reduction lands (overlapped); ``late``: all of them after the backward."""
    data = batches(global_batch)
    want_losses, want_norms, want_weights = reference(data, clip, ckpt)
    force, group = group < 0, abs(group)
    results = run_ranks(world, _train_hybrid, group, data, micro, clip, ckpt, force, late)
    got_losses, got_norms, got_weights, sizes = results[0]
    assert sizes == (world // group, group)
    assert max_rel(got_losses, want_losses) < 1e-5
    assert max_rel(got_norms, want_norms) < 1e-5
    assert weights_rel(got_weights, want_weights) < 1e-5
    assert want_losses[-1] < untrained(data)[0][-1] - TRAINED_MARGIN
    for other in results[1:]:  # replicas and group members agree exactly
        assert other[1] == got_norms
        assert weights_rel(other[2], got_weights) == 0.0


def _one_step_traffic(rank, world, group_size):
    model = build_model(CFG)
    mesh = hybrid_mesh("cpu", group_size) if group_size else None
    engine = engine_for(model, mesh=mesh)
    opt = optimizer_for(engine.param_groups(0.1))
    tokens = batches(world, steps=1)[0][rank : rank + 1]
    before = engine.bytes_sent_intra, engine.bytes_sent_cross
    train_step(model, engine, opt, [(tokens[:, :-1], tokens[:, 1:])], grad_clip=1.0)
    shard_bytes = 4 * (engine.shards.master.numel() + engine.shards.small_master.numel())
    intra = engine.bytes_sent_intra - before[0]
    cross = engine.bytes_sent_cross - before[1]
    planned = planned_traffic(engine)
    # what the engine skips: units still resident from the forward are not gathered again
    resident = sum(4 * layout.padded_numel for layout in engine.layouts[-2:])
    resident = resident * (engine.shard_size - 1) // engine.shard_size
    return intra, cross, shard_bytes, engine.bytes_sent, planned, resident


def test_traffic_splits_into_intra_and_cross_group_bytes():
    """2 x 2: the replicas send each rank's fp32 gradient shard once (ring all-reduce over
    2 ranks: 2 x (2-1)/2 = 1 x the shard), the groups gather and reduce within; full
    sharding at 4 sends nothing across groups. The planner's formula (``step_traffic``)
    gives the cross-group bytes exactly and the in-group bytes as an upper bound that is off
    only by the re-gathers the engine skips (the last two units, resident after forward)."""
    hybrid = run_ranks(4, _one_step_traffic, 2)
    full = run_ranks(4, _one_step_traffic, None)
    for intra, cross, _, total, planned, resident in hybrid + full:
        assert total == intra + cross
        assert cross == planned.cross
        assert planned.intra - resident == intra
    for intra, cross, shard_bytes, _, _, _ in hybrid:
        assert cross == shard_bytes and intra > 0
    for intra, cross, _, _, _, _ in full:
        assert cross == 0 and intra > hybrid[0][0]
