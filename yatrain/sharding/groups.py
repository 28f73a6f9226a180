"""Which ranks shard a unit between them and which hold copies of it (hybrid sharding).

Full sharding: every rank holds 1/W of every unit; the engine runs on one process group
(the whole world, or the one it is given). Hybrid sharding (HSDP): ranks form contiguous
shard groups of G (``[0..G-1], [G..2G-1], ...``; with G = GPUs per node, one group per
node), each unit is sharded, gathered and reduce-scattered within its group only, and the
groups are replicas of each other: rank i of every group holds the same shard. Once per step
the accumulated fp32 gradient shards are all-reduced across replicas (rank i of each group),
so only 1/G of the gradient crosses between groups.

The layout is a 2-D ``DeviceMesh`` (dim 0: replicas, dim 1: the shard group), built with
``hybrid_mesh`` by every rank in the same order (``init_device_mesh`` is collective). A
checkpoint is sharded over the same mesh (``Replicate`` on dim 0, ``Shard(0)`` on dim 1):
each shard keeps its global offset, so a checkpoint does not depend on the layout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from yatrain.sharding.comm import Communicator, GlooCommunicator
from yatrain.sharding.cuda_comm import CudaStreamCommunicator
from yatrain.sharding.fake_streams import FakeStreams

REPLICATE, SHARD = "replicate", "shard"  # the mesh's dimension names
# The last mesh ``hybrid_mesh`` built: the world's process group, (device type, shape), mesh.
_BUILT: list[tuple[dist.ProcessGroup | None, tuple[str, tuple[int, int]], DeviceMesh]] = []


def hybrid_mesh(device_type: str, shard_group_size: int) -> DeviceMesh:
    """The (replicas, shard group) mesh over the whole world; collective the first time.
    Asked again in the same world for the same layout, it is the mesh already built:
    ``init_device_mesh`` makes new process groups (communicators) on every call, and a
    second engine in one job shards over the same ranks. A dry run builds it this way before
    its fake tensors exist (a mesh reads its ranks from a tensor)."""
    world = dist.get_world_size()
    if shard_group_size < 1 or world % shard_group_size:
        raise ValueError(f"world size {world} is not a multiple of shard group {shard_group_size}")
    shape = (world // shard_group_size, shard_group_size)
    for built_in, built_for, mesh in _BUILT:
        if built_in is dist.group.WORLD and built_for == (device_type, shape):
            return mesh
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=(REPLICATE, SHARD))
    _BUILT[:] = [(dist.group.WORLD, (device_type, shape), mesh)]  # a new world replaces it
    return mesh


def communicators(
    group: dist.ProcessGroup | None,
    mesh: DeviceMesh | None,
    device: torch.device,
    *,
    force_group: bool,
    cuda_path: bool = False,
) -> tuple[Communicator, Communicator | None]:
    """(the shard group's communicator, the replicas' or None) for a process ``group`` or a
    ``mesh`` (1-D: full sharding over it; 2-D: replicas x shard group); ``cuda_path``: see
    ``make_communicator``."""
    if mesh is None:
        return make_communicator(group, device, force_group=force_group, cuda_path=cuda_path), None
    if group is not None:
        raise ValueError("pass a process group or a device mesh, not both")
    if mesh.ndim == 1:
        one = mesh.get_group()
        return make_communicator(one, device, force_group=force_group, cuda_path=cuda_path), None
    if mesh.ndim != 2:
        raise ValueError(f"the engine takes a 1-D or 2-D device mesh, got {mesh.ndim}-D")
    peers = None  # every shard group, read from the mesh only for Gloo's groups of its own
    if device.type != "cuda" and not cuda_path:
        peers = [row.tolist() for row in mesh.mesh]
    shard = make_communicator(
        mesh.get_group(1), device, force_group=force_group, peers=peers, cuda_path=cuda_path
    )
    replicas = mesh.size(0)
    if replicas == 1:
        return shard, None
    return shard, make_communicator(mesh.get_group(0), device, cuda_path=cuda_path)


def make_communicator(
    group: dist.ProcessGroup | None,
    device: torch.device,
    *,
    force_group: bool = False,
    peers: list[list[int]] | None = None,
    cuda_path: bool = False,
) -> Communicator:
    """Pick the implementation for this device. A single process needs no process group;
    ``force_group`` uses the group's collectives even with one rank (tests the real path).
    ``peers``: the ranks of every group like ``group`` (shard groups, see groups.py).
    ``cuda_path``: the CUDA kind on a CPU device too, on streams and events that do nothing
    (``fake_streams.py``): what a dry run measures, since a GPU rank runs that path."""
    initialized = dist.is_available() and dist.is_initialized()
    if force_group and not initialized:
        raise RuntimeError(
            "force_process_group needs an initialised process group (one rank is enough)"
        )
    if not initialized or (dist.get_world_size(group) == 1 and not force_group):
        return Communicator()
    if device.type == "cuda":
        return CudaStreamCommunicator(group, device)
    if cuda_path:
        return CudaStreamCommunicator(group, device, FakeStreams())
    return GlooCommunicator(group, peers)
