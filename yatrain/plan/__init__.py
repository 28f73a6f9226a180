"""Memory planning (how much a step needs per GPU, how many layers to checkpoint) and the
sequence-length sweep that measures it."""

from yatrain.plan.memory import (
    MemoryPlan,
    engine_state_bytes,
    plan_for_layers,
    plan_memory,
    resolve_auto_checkpoint_layers,
)
from yatrain.plan.memtrack import LiveTensorTracker

__all__ = [
    "LiveTensorTracker",
    "MemoryPlan",
    "engine_state_bytes",
    "plan_for_layers",
    "plan_memory",
    "resolve_auto_checkpoint_layers",
]
