"""The state dicts a checkpoint holds, as DCP sees them: views of the engine's shards.

What is saved is the engine's own view of its state (``ShardedEngine.sharded_state``): the
fp32 master weights and AdamW moments as flat tensors under the engine's names, each rank
contributing its contiguous slice with its global offset. Wrapped as dim-0 sharded DTensors,
those offsets reach DCP, so a checkpoint loads at any world size. Nothing here copies: DCP
writes from, and loads into, the engine's and AdamW's own tensors.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.optim import Optimizer

from yatrain.checkpoint.optimizer_state import ensure_state, step_count
from yatrain.sharding import ShardedEngine, ShardView


def as_dcp_tensor(view: ShardView, mesh: DeviceMesh | None) -> torch.Tensor:
    """A rank's piece as DCP sees it: a dim-0 sharded DTensor (under hybrid sharding,
    replicated across the mesh's first dimension: DCP writes each piece once), or the whole
    tensor alone. Pieces keep their global offsets, so any layout loads any checkpoint."""
    if mesh is None:
        return view.local
    shape = torch.Size([view.numel])
    placements = [Shard(0)] if mesh.ndim == 1 else [Replicate(), Shard(0)]
    return DTensor.from_local(
        view.local, mesh, placements, run_check=False, shape=shape, stride=(1,)
    )


def training_state(engine: ShardedEngine, optimizer: Optimizer, mesh: DeviceMesh | None) -> dict:
    """Views of the engine's shards and AdamW moments, wrapped for DCP (no copies)."""
    ensure_state(optimizer)
    state: dict = {
        group: {key: as_dcp_tensor(view, mesh) for key, view in views.items()}
        for group, views in engine.sharded_state(optimizer).items()
    }
    state["adam_step"] = step_count(optimizer)
    # No RNG state: nothing in training draws from a global generator (init uses per-unit
    # generators, the data order its own seeded permutation, and there is no dropout), so
    # there is nothing to restore. tests/integration/test_checkpoint.py reseeds the global
    # RNG between the halves of a resumed run to keep it that way.
    return state


def weights_state(engine: ShardedEngine, mesh: DeviceMesh | None) -> dict:
    """Views of the engine's weight shards only, wrapped for DCP (evaluation: no optimizer)."""
    views = engine.sharded_state()["model"]
    return {"model": {key: as_dcp_tensor(view, mesh) for key, view in views.items()}}
