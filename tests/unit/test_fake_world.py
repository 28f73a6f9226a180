"""What a dry run needs of the package: one process as rank 0 of a fake world (torch's fake
process group) on fake tensors (``FakeTensorMode``): the engine builds, groups of our own take
the fake world's backend, the tracker counts fake storages, and the CUDA path runs on a CPU on
streams whose events report done."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist
from conftest import ROOT
from distributed import run_ranks

# FakeTensorMode and the fake process group: the house rules' allowed exceptions for dry runs.
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from yatrain.checkpoint import dcp_io
from yatrain.checkpoint.background_save import AsyncSaver
from yatrain.plan.memtrack import LiveTensorTracker
from yatrain.recipe.load import load_recipe
from yatrain.runtime.process import Runtime
from yatrain.sharding.comm import GlooCommunicator, host_backend
from yatrain.sharding.cuda_comm import CudaStreamCommunicator
from yatrain.sharding.groups import make_communicator
from yatrain.sharding.materialize import _materialize
from yatrain.train.build import build_model_and_engine, meta_model, shard_model

WORLD = 8
CPU = torch.device("cpu")


@pytest.fixture
def fake_world():
    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _tiny():
    recipe = load_recipe(ROOT / "recipes" / "tiny.yaml", ["data.global_batch_size=64"])
    return recipe, Runtime(rank=0, world_size=WORLD, local_rank=0, device=CPU)


@pytest.mark.parametrize("meta_outside", [False, True])
def test_the_tiny_recipe_builds_at_world_8_on_fake_tensors(fake_world, meta_outside):
    """The meta model made under the fake mode (its parameters are fake and torch will not
    swap them) or before it (real meta tensors: the decoder layers' norms were materialised
    twice, and the second swap of a fake parameter failed)."""
    recipe, runtime = _tiny()
    model = meta_model(recipe, WORLD) if meta_outside else None
    with FakeTensorMode(allow_non_fake_inputs=True):
        if model is None:
            model, engine = build_model_and_engine(recipe, runtime)
        else:
            engine = shard_model(model, recipe, runtime)
    total = sum(lay.padded_numel for lay in engine.layouts)
    assert isinstance(engine.shards.master, FakeTensor)
    assert engine.shards.master.numel() * WORLD == total
    assert dist.get_backend(engine.buffers.reducer.comm.group) == "fake"


def test_materialise_leaves_materialised_tensors_and_keeps_shared_ones_shared():
    with torch.device("meta"):
        first, second, norm = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3), torch.nn.LayerNorm(3)
    second.weight = first.weight
    norm.to_empty(device=CPU)
    done = norm.weight
    unit = torch.nn.Sequential(first, second, norm)
    _materialize(unit, CPU)
    assert not any(p.is_meta for p in unit.parameters())
    assert first.weight is second.weight and norm.weight is done


def test_groups_of_our_own_take_the_fake_worlds_backend(fake_world):
    """The reducer's second group, a shard group's, the async saver's group and host mesh,
    and DCP's one-rank group: gloo cannot be built on a fake store."""
    assert host_backend() == "fake"
    whole = GlooCommunicator(None).second_group()
    peers = [[0, 1, 2, 3], [4, 5, 6, 7]]
    shard = GlooCommunicator(None, peers).second_group()
    saver = AsyncSaver(CPU, init_device_mesh("cpu", (WORLD,)), timeout_s=60)
    with dcp_io._group(alone=True) as alone:
        assert dist.get_backend(alone) == "fake"
    assert dist.get_process_group_ranks(shard.group) == peers[0]
    groups = [whole.group, shard.group, saver.group, saver.stager.mesh.get_group()]
    assert [dist.get_backend(group) for group in groups] == ["fake"] * 4
    saver._executor.shutdown()


def _backend_beside(rank, world):
    return host_backend(), dist.get_backend(GlooCommunicator(None).second_group().group)


def test_a_gloo_world_keeps_gloo_groups():
    assert run_ranks(2, _backend_beside) == [("gloo", "gloo")] * 2


def test_the_tracker_counts_fake_storages_by_identity():
    """Every fake storage's address is 0: by address, the second tensor would be the first.
    Views add nothing; meta tensors hold no memory; a freed storage is taken off."""
    with FakeTensorMode(), LiveTensorTracker() as mem:
        first = torch.empty(100)
        second = torch.empty(50, dtype=torch.float64)
        view = first[10:]
        torch.empty(7, device="meta")
        assert mem.current == 100 * 4 + 50 * 8
        del second
        gc.collect()
        assert mem.current == 100 * 4 and mem.peak == 100 * 4 + 50 * 8
        assert view.shape == (90,)


def test_the_cuda_path_on_a_cpu_reports_its_collectives_done(fake_world):
    """``cuda_path``: the CUDA communicator on a CPU device, on fake streams; its events
    report done, so the stream reducer lets go of a gradient at once."""
    comm = make_communicator(None, CPU, cuda_path=True)
    assert isinstance(comm, CudaStreamCommunicator)
    assert not isinstance(make_communicator(None, CPU), CudaStreamCommunicator)
    out, shard = torch.zeros(WORLD * 4), torch.ones(4)
    handle = comm.all_gather(out, shard)
    assert comm.finished(handle)
    comm.wait(handle)
    assert comm.traffic()["all_gather"] == (1, 4 * 4 * (WORLD - 1))


def _cuda_path_gather(rank, world):
    comm = make_communicator(None, CPU, cuda_path=True)
    out = torch.zeros(world * 3)
    comm.wait(comm.all_gather(out, torch.full((3,), float(rank))))
    full = torch.ones(world * 2)
    shard = torch.zeros(2)
    comm.wait(comm.reduce_scatter(shard, full))
    comm.all_reduce_sum(torch.ones(()))
    return type(comm).__name__, out.tolist(), shard.tolist(), comm.traffic()


def test_the_cuda_path_on_a_cpu_moves_real_data_on_gloo():
    """Two gloo ranks, the CUDA communicator on fake streams: the data lands, and each kind
    is counted with its ring bytes."""
    for name, gathered, reduced, traffic in run_ranks(2, _cuda_path_gather):
        assert name == "CudaStreamCommunicator"
        assert gathered == [0.0] * 3 + [1.0] * 3 and reduced == [2.0, 2.0]
        assert traffic == {
            "all_gather": (1, 12),
            "reduce_scatter": (1, 8),
            "all_reduce": (1, 4),
            "all_to_all": (0, 0),
        }
