"""The engine's paths beyond the plain one: the buffered path on one rank, reduce-scatters in
many pieces, no gather for a backward that reads no weights, buffers as ``sizes.py`` says."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from distributed import run_ranks
from engine_reference import (
    CFG,
    batches,
    engine_for,
    loss_of,
    max_rel,
    optimizer_for,
    reference,
    train_sharded,
    weights_rel,
)
from torch import nn

from yatrain.models.llama import build_model
from yatrain.sharding.comm import Communicator
from yatrain.sharding.contract import backward_reads_weights
from yatrain.sharding.reduce import ThreadReducer
from yatrain.train.step import train_step


def test_one_rank_process_group_gives_exactly_the_direct_path():
    """``force_process_group``: gathers, gradient buffers, reduce-scatter pieces and the
    helper thread, with one rank; every loss, gradient norm and weight bit-identical."""
    data = batches(4, steps=4)
    for dtype in ("fp32", "bf16"):
        direct = train_sharded(0, 1, data, 2, 0.5, 1, dtype)
        forced_run = functools.partial(train_sharded, force_process_group=True)
        forced = run_ranks(1, forced_run, data, 2, 0.5, 1, dtype)
        assert forced[0][0] == direct[0] and forced[0][1] == direct[1]
        assert weights_rel(forced[0][2], direct[2]) == 0.0


@pytest.mark.parametrize(
    "world,dtype,reduce", [(2, "fp32", "fp32"), (3, "fp32", "fp32"), (2, "bf16", "fp32")]
)
def test_many_small_reduce_scatter_pieces(world, dtype, reduce):
    """A staging budget of 37 fp32 elements per rank: every unit's gradient in many equal
    pieces, the last one shorter (and, at world 3, padded), over two micro-batches; fp32
    equals the reference."""
    data = batches(2 * world, steps=3)
    in_pieces = functools.partial(train_sharded, staging_bytes=37 * world * 4)
    got = run_ranks(world, in_pieces, data, 1, 0.5, 0, dtype, reduce)[0]
    whole = run_ranks(world, train_sharded, data, 1, 0.5, 0, dtype, reduce)[0]
    if dtype == "fp32":
        want_losses, want_norms, want_weights = reference(data, 0.5)
        assert max_rel(got[0], want_losses) < 1e-5 and max_rel(got[1], want_norms) < 1e-5
        assert weights_rel(got[2], want_weights) < 1e-5
    assert max_rel(got[0], whole[0]) < 1e-6  # pieces change nothing but the order of work


def _gathers(rank, world):
    model = build_model(CFG)
    engine = engine_for(model)
    seen = []
    gather = engine.gathers.gather
    engine.gathers.gather = lambda unit: (seen.append((engine.phase, unit)), gather(unit))[1]
    for step in batches(2, steps=2):
        seen.clear()
        loss_of(model, step[rank : rank + 1]).backward()
        engine.reduce_gradients()
        engine.clip_grad_norm_(0.0)
        engine.after_step()
    return seen, engine.n_units


def test_embedding_is_not_gathered_for_its_backward():
    """Its gradient is a scatter-add of the output gradient: no weights needed."""
    seen, n_units = run_ranks(2, _gathers)[0]
    forward = [unit for phase, unit in seen if phase == "forward"]
    backward = [unit for phase, unit in seen if phase == "backward"]
    assert sorted(set(forward)) == list(range(n_units))
    assert 0 not in backward and backward  # layers evicted by the rotation come back


def test_which_units_read_their_weights_in_backward():
    assert not backward_reads_weights(nn.Embedding(4, 2))
    assert backward_reads_weights(nn.Linear(2, 2))
    declared = nn.Linear(2, 2)
    declared.backward_reads_weights = False  # a model's own declaration wins
    assert not backward_reads_weights(declared)


def _allocations(rank, world, dtype):
    model = build_model(CFG)
    engine = engine_for(model, param_dtype=dtype)
    plan = engine.buffer_plan()
    gathers = {id(b): b.data for b in engine.buffers.buffer_of}.values()
    slots = {id(s): s.data for s in engine.buffers.slot_of if s is not None}.values()
    reducer = engine.buffers.reducer
    return (
        sorted((t.numel(), t.dtype) for t in gathers),
        sorted((t.numel(), t.dtype) for t in slots),
        (reducer.staging.numel(), reducer.staging.dtype, reducer.out.numel()),
        plan,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_allocates_what_sizes_py_plans(dtype):
    gathers, slots, staging, plan = run_ranks(2, _allocations, dtype)[0]
    want = [(plan.gather.numel, plan.gather.dtype)] * plan.gather.count
    want += [(plan.edge_gather.numel, plan.edge_gather.dtype)] * plan.edge_gather.count
    assert gathers == sorted(want)
    assert slots == [(plan.grad.numel, plan.grad.dtype)] * plan.grad.count
    assert staging == (plan.staging.numel, plan.staging.dtype, plan.reduce_out.numel)


def test_a_failed_reduce_scatter_in_the_helper_thread_reaches_the_training_thread():
    """The error is raised as the helper thread saw it (a lost peer stays a lost peer)."""

    class Failing(Communicator):
        def __init__(self):
            super().__init__()
            self.world_size = 2

        def reduce_scatter(self, out, full, *, before=None, then=None):
            raise ConnectionError("peer gone")

    reducer = ThreadReducer(Failing(), torch.empty(8), torch.empty(4), 4)
    reducer.submit(torch.ones(8), 8, torch.empty(4), None)
    with pytest.raises(ConnectionError, match="peer gone"):
        reducer.drain()


def _step_traffic(rank, world, staging_elements):
    """One step (one micro-batch, bf16 weights, fp32 reduction) of every communicator the
    engine uses, and what the layout says it must be."""
    model = build_model(CFG)
    staging = staging_elements * world * 4
    engine = engine_for(model, param_dtype=torch.bfloat16, staging_bytes=staging)
    opt = optimizer_for(engine.param_groups(0.1))
    tokens = batches(world, steps=1)[0][rank : rank + 1]
    before = engine.traffic()  # every communicator of the engine, merged
    train_step(model, engine, opt, [(tokens[:, :-1], tokens[:, 1:])], grad_clip=1.0)
    after = engine.traffic()
    got = {
        kind: tuple(after[kind][i] - before.get(kind, (0, 0))[i] for i in (0, 1))
        for kind in ("all_gather", "reduce_scatter", "all_reduce")
    }
    units = engine.layouts
    layouts = [*units, engine.small]
    again = [*engine.reads_weights[:-2], False, False, False]  # the last two stay resident

    def sent(nbytes):
        return nbytes * (world - 1) // world

    gathered = [sent(2 * lay.padded_numel) * (1 + b) for lay, b in zip(layouts, again, strict=True)]
    want = {
        "all_gather": (len(layouts) + sum(again), sum(gathered)),
        "reduce_scatter": (
            # the norms' fp32 gradient, accumulated here, goes out whole once a step
            1 + sum(math.ceil(lay.padded_numel // world / staging_elements) for lay in units),
            sum(sent(4 * lay.padded_numel) for lay in layouts),
        ),
        "all_reduce": (1, sent(2 * 4)),  # the gradient norm's squared sum, one fp32 scalar
    }
    return got, want


@pytest.mark.parametrize("staging_elements", [37, 1 << 20])
def test_collectives_are_counted_per_kind(staging_elements):
    """Gathers (forward, and backward for units gone from memory), reduce-scatters (each
    unit's gradient in pieces of ``staging_elements`` columns, or whole; the norms' once)
    and the gradient norm's all-reduce of one step, counted and sized from the layout (ring
    bytes, bf16 gathers), over both the engine's communicator and its reducer's."""
    for got, want in run_ranks(2, _step_traffic, staging_elements):
        assert got == want
