"""Memory planning: how much a step needs per device and how many layers to checkpoint.

Pure arithmetic on the recipe (``memory``), checked against live tensors (``memtrack``);
``limits`` decides what to plan against, ``budget`` what a run has; ``fit`` resolves a
run's ``auto`` and refuses a run that will not fit, in one plan, before it starts;
``report`` words the answer.
Below the training loop: it imports no part of ``yatrain.train``.
"""

from yatrain.plan.budget import MemoryBudget, memory_budget
from yatrain.plan.fit import start_plan
from yatrain.plan.limits import memory_limit, resolve_auto_checkpoint_layers
from yatrain.plan.memory import MemoryPlan, engine_state_bytes, plan_for_layers
from yatrain.plan.memtrack import LiveTensorTracker
from yatrain.plan.report import explain, format_plan
from yatrain.plan.search import plan_memory

__all__ = [
    "LiveTensorTracker",
    "MemoryBudget",
    "MemoryPlan",
    "engine_state_bytes",
    "explain",
    "format_plan",
    "memory_limit",
    "plan_for_layers",
    "plan_memory",
    "memory_budget",
    "resolve_auto_checkpoint_layers",
    "start_plan",
]
