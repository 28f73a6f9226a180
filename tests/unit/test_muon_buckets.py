"""Muon's exchange bucket by bucket: the same bits as one bucket, a pipeline that sends the next
bucket before the owners' Newton-Schulz, the peak memory ``exchange_memory`` predicts, its
all-to-alls ordered by events on the CUDA path, and its time in the step's breakdown.

Every layer of the test model (10,752 matrix elements) is a bucket of its own at
``LAYER_MIB``; the default (256 MiB) puts the whole model in one bucket, the exchange as it
was before buckets.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
from distributed import run_ranks
from engine_reference import CFG, SEED, batches, engine_for, train_sharded

from yatrain.common import DTYPES
from yatrain.models.llama import DecoderLayer, build_model
from yatrain.optim import exchange as exchange_module
from yatrain.optim.exchange import MatrixExchange
from yatrain.optim.exchange_memory import exchange_peak_bytes
from yatrain.optim.exchange_plan import assign_owners, bucket_numel, group_units
from yatrain.plan.memtrack import LiveTensorTracker
from yatrain.recipe.config import OptimConfig
from yatrain.sharding import ShardedEngine
from yatrain.sharding.cuda_comm import CudaStreamCommunicator
from yatrain.sharding.groups import hybrid_mesh
from yatrain.testing import cuda_standin
from yatrain.train.optim import run_optimizer
from yatrain.train.step import train_step
from yatrain.train.timing import StepClock

LAYER_MIB = 0.02  # < one layer's 10,752 elements in fp32 or bf16: one layer a bucket
TWO_LAYERS_MIB = 0.09  # 23,592 fp32 elements: two layers, then one
OPTIM = OptimConfig(lr=3e-3, min_lr=3e-4, warmup_steps=1, name="muon", muon_ns_dtype="fp32")


def _layers(model) -> list[int]:
    return [i for i, unit in enumerate(model.units()) if isinstance(unit, DecoderLayer)]


def test_buckets_are_consecutive_layers_of_about_the_size():
    model = build_model(CFG)
    engine = engine_for(model)
    maps = [engine.matrix_map(u) for u in _layers(model)]
    assert bucket_numel(None, torch.float32) is None
    assert bucket_numel(LAYER_MIB, torch.bfloat16) == 10_485
    assert group_units(maps, None) == [range(0, 3)]
    assert group_units(maps, bucket_numel(LAYER_MIB, torch.float32)) == [
        range(i, i + 1) for i in range(3)
    ]
    assert group_units(maps, bucket_numel(TWO_LAYERS_MIB, torch.float32)) == [
        range(0, 2),
        range(2, 3),
    ]
    assert group_units(maps, 3 * 10_752) == [range(0, 3)]


def test_owners_spread_each_bucket_on_the_loads_so_far():
    """One bucket: the assignment over all the matrices at once. Two buckets on two
    ranks: each bucket's work on both, where one pass over all the jobs puts the first
    bucket on rank 0 alone."""
    costs = [100, 60, 50, 40, 10]
    assert assign_owners(costs, 2, [5]) == assign_owners(costs, 2) == [0, 1, 1, 0, 1]
    assert assign_owners([9, 1, 9, 1], 2) == [0, 0, 1, 1]
    assert assign_owners([9, 1, 9, 1], 2, [2, 2]) == [0, 1, 1, 0]  # rank 1 was the lighter


def _three_ways(rank, world, layout):
    """The same training with one bucket, two and three: losses, norms, weights of each."""
    options = {"mesh": hybrid_mesh("cpu", 2)} if layout in ("repeat", "split") else {}
    optim = dataclasses.replace(OPTIM, muon_hsdp=layout) if options else OPTIM
    data = batches(4, steps=3)
    runs = []
    for mib in (None, TWO_LAYERS_MIB, LAYER_MIB):
        chosen = dataclasses.replace(optim, muon_bucket_mib=mib)
        runs.append(train_sharded(rank, world, data, 1, 0.5, 0, optim=chosen, **options))
    return runs


@pytest.mark.parametrize("world,layout", [(2, "full"), (4, "split"), (4, "repeat")])
def test_one_bucket_and_many_train_the_same_bits(world, layout):
    for one, *many in run_ranks(world, _three_ways, layout):
        for other in many:
            assert other[0] == one[0] and other[1] == one[1]  # losses, norms: bitwise
            assert all(torch.equal(other[2][k], w) for k, w in one[2].items())


def _exchange(rank, world, layout, mib, dtype):
    """A real exchange of the test model's layers on this rank, and updates for it."""
    model = build_model(CFG)
    options = {"mesh": hybrid_mesh("cpu", 1)} if layout == "split" else {}
    engine = engine_for(model, **options)
    layers = _layers(model)
    maps = [engine.matrix_map(u) for u in layers]
    replicas = engine.replica_comm if layout == "split" else None
    exchange = MatrixExchange(maps, engine.comm, replicas, bucket_numel(mib, dtype))
    shards = [g["params"][0] for g in engine.unit_groups(0.0) if g["unit"] in layers]
    gen = torch.Generator().manual_seed(SEED + engine.rank)  # replicas: the same shards
    updates = [torch.randn(s.shape, generator=gen) for s in shards]
    return engine, exchange, updates


def _settled(wait):
    """``wait``, then a millisecond: gloo's worker thread lets go of a finished collective's
    tensors a moment after ``wait`` returns (about 1 run in 30 here, a buffer outlived the
    exchange's last reference by a few microseconds and the tracker counted it beside the
    next one). The tracker should see what the exchange holds, not that race."""

    def settled(handle):
        wait(handle)
        time.sleep(1e-3)

    return settled


def _peaks(rank, world, layout, dtype_name):
    """The tracker's peak around ``orthogonalize`` and ``exchange_peak_bytes``, with one
    bucket and with one layer a bucket; and whether both gave the same results."""
    dtype, found, results = DTYPES[dtype_name], [], []
    for mib in (None, LAYER_MIB):
        engine, exchange, updates = _exchange(rank, world, layout, mib, dtype)
        for comm in filter(None, (engine.comm, engine.replica_comm)):
            comm.wait = _settled(comm.wait)
        out = [torch.zeros(u.shape, dtype=dtype) for u in updates]

        def land(pieces, back, out=out):  # copies only: no storage of its own
            for p in pieces:
                out[p.unit].narrow(0, p.in_shard, p.length).copy_(back.narrow(0, p.at, p.length))

        with LiveTensorTracker("cpu") as mem:
            before = mem.current
            exchange.orthogonalize(updates, 5, dtype, land)
        found.append((mem.peak - before, exchange_peak_bytes(exchange, dtype.itemsize)))
        results.append(out)
    same = all(torch.equal(a, b) for a, b in zip(*results, strict=True))
    return found, same


@pytest.mark.parametrize("layout,dtype", [("full", "bf16"), ("full", "fp32"), ("split", "bf16")])
def test_the_exchanges_peak_memory_is_what_exchange_memory_says(layout, dtype):
    """At world 2 (a group of 2; or split over 2 replicas of one rank each): the live-tensor
    tracker's peak around a real ``orthogonalize`` equals the function's, byte for byte,
    with one bucket and with three; three hold less, and give the same results."""
    for found, same in run_ranks(2, _peaks, layout, dtype):
        (one_tracked, one_said), (many_tracked, many_said) = found
        assert one_tracked == one_said > 0
        assert many_tracked == many_said < one_said
        assert same


def _logged(rank, world):
    """The exchange's collectives, waits, Newton-Schulz runs and landings, in order."""
    engine, exchange, updates = _exchange(rank, world, "full", LAYER_MIB, torch.float32)
    log, comm = [], engine.comm
    post, wait, ns = comm.all_to_all, comm.wait, exchange_module.zeropower
    comm.all_to_all = lambda *a: log.append("a2a") or post(*a)
    comm.wait = lambda handle: log.append("wait") or wait(handle)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(exchange_module, "zeropower", lambda *a, **k: log.append("ns") or ns(*a, **k))
        exchange.orthogonalize(updates, 5, torch.float32, lambda *_: log.append("land"))
    return log, [len(b.received) for b in exchange.buckets]


def test_the_next_bucket_goes_out_before_the_owners_newton_schulz():
    """Bucket b + 1 is sent before bucket b's Newton-Schulz, b's results go back before
    anything later is waited on, and b - 1 has landed before b + 1 is sent."""
    for log, owned in run_ranks(2, _logged):
        want = ["a2a"]
        for b, count in enumerate(owned):
            want += ["wait", "land"] if b > 0 else []  # bucket b - 1 back
            want += ["a2a"] if b + 1 < len(owned) else []  # bucket b + 1 out
            want += ["wait", *["ns"] * count, "a2a"]  # bucket b in, orthogonalised, back
        assert log == [*want, "wait", "land"]
        assert len(owned) == 3 and sum(owned) > 0


def _cuda_path(rank, world, layout):
    """Two Muon steps of one layer a bucket on the CUDA path's stand-in streams, timed by a
    step clock whose exchange clocks use (fake) CUDA events; the stand-in's findings."""
    optim = dataclasses.replace(OPTIM, muon_bucket_mib=LAYER_MIB, muon_hsdp="split")
    options = {"mesh": hybrid_mesh("cpu", 1)} if layout == "split" else {}
    with pytest.MonkeyPatch.context() as patch:
        order = cuda_standin.as_if_cuda(patch)
        with order.recording():
            model = build_model(CFG)
            engine = ShardedEngine.from_model(
                model, device="cpu", seed=SEED, force_process_group=True, **options
            )
            assert isinstance(engine.comm, CudaStreamCommunicator)
            engine.comm.clock.cuda = True
            opt = run_optimizer(engine, model, optim)
            clock = StepClock(engine, torch.device("cpu"))
            for step in batches(2, steps=2):
                mine = step[rank : rank + 1]
                micros = [(mine[:, :-1], mine[:, 1:])]
                train_step(model, engine, opt, micros, grad_clip=0.5, clock=clock)
            clock.take()
    return order.violations, dict(order.counts), len(opt.exchange.buckets)


@pytest.mark.parametrize("layout", ["full", "split"])
def test_cuda_path_orders_every_buckets_all_to_alls_by_events(layout):
    for violations, counts, buckets in run_ranks(2, _cuda_path, layout):
        assert not violations, "\n".join(violations[:8])
        assert buckets == 3
        if layout == "full":
            assert counts["all_to_all_single on comm1"] == 2 * 3 * 2, counts
        else:  # the group's two a bucket (one rank: nothing crosses) and the replicas' one
            assert counts["all_to_all_single on comm1"] == 2 * 3 * 2, counts
            assert counts["all_to_all_single on comm2"] == 3 * 2, counts


def _breakdown(rank, world, nap):
    """One Muon step timed by a ``StepClock``; rank 0's Newton-Schulz naps ``nap`` seconds
    a matrix. Its (compute, exposed communication, optimizer) and rank 0's napping."""
    model = build_model(CFG)
    engine = engine_for(model)
    opt = run_optimizer(engine, model, dataclasses.replace(OPTIM, muon_bucket_mib=LAYER_MIB))
    clock = StepClock(engine, torch.device("cpu"))
    slow, real = 0, exchange_module.zeropower
    if rank == 0:
        slow = nap * sum(len(b.received) for b in opt.exchange.buckets)
        exchange_module.zeropower = lambda *a, **k: time.sleep(nap) or real(*a, **k)
    step = batches(2, steps=1)[0][rank : rank + 1]
    train_step(model, engine, opt, [(step[:, :-1], step[:, 1:])], grad_clip=0.5, clock=clock)
    return clock.take(), slow


def test_the_breakdown_counts_newton_schulz_as_compute_and_the_waits_as_communication():
    """Rank 0's slow Newton-Schulz is its compute, not its optimizer time; rank 1, whose
    owners finish at once, waits for rank 0's results: exposed communication."""
    (mine, slow), (theirs, _) = run_ranks(2, _breakdown, 0.03)
    assert slow >= 0.15
    assert mine[0] >= slow and mine[2] < slow / 2
    assert theirs[1] >= slow / 2 and theirs[2] < slow / 2
