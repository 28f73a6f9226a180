"""Memory planning: how much a step needs per device and how many layers to checkpoint.

Pure arithmetic on the recipe (``memory``), checked against live tensors (``memtrack``);
``limits`` decides what to plan against and resolves ``auto``; ``fit`` refuses a run that
will not fit before it starts; ``report`` words the answer.
Below the training loop: it imports no part of ``yatrain.train``.
"""

from yatrain.plan.fit import check_fit
from yatrain.plan.limits import memory_limit, resolve_auto_checkpoint_layers
from yatrain.plan.memory import MemoryPlan, engine_state_bytes, plan_for_layers, plan_memory
from yatrain.plan.memtrack import LiveTensorTracker
from yatrain.plan.report import explain, format_plan

__all__ = [
    "LiveTensorTracker",
    "check_fit",
    "MemoryPlan",
    "engine_state_bytes",
    "explain",
    "format_plan",
    "memory_limit",
    "plan_for_layers",
    "plan_memory",
    "resolve_auto_checkpoint_layers",
]
