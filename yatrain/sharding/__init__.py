"""The sharded data-parallel engine (YaFSDP-style). It knows no model, recipe or loop: a
model satisfies ``ShardableModel``; ``ShardedEngine.from_model`` shards it; the engine's
saved state is described by ``StateEntry`` / ``ShardView``; ``hybrid_mesh`` lays ranks out
as replicas of shard groups (HSDP)."""

from yatrain.sharding.contract import InitHooks, ShardableModel
from yatrain.sharding.engine import ShardedEngine
from yatrain.sharding.groups import hybrid_mesh
from yatrain.sharding.state import ShardView, StateEntry, describe_state

__all__ = [
    "InitHooks",
    "ShardView",
    "ShardableModel",
    "ShardedEngine",
    "StateEntry",
    "describe_state",
    "hybrid_mesh",
]
