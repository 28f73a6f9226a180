"""What the dry run's tensor peak is made of, tracked and planned, in the same categories.

Tracked (``CategoryMeter``, the loop's meter whose counted step also sorts): the engine's
master shards, gather buffers and gradient buffers (its preallocated ones and the fp32
gradient shards) and the optimizer's state, by tensor identity; activations (what the
model's forward allocates: its layers', embedding's and norms' tensors and its attention
masks, a checkpointed layer's recompute in the backward included) and the output head with
its fused loss, by the module running when a storage is allocated; everything else (the
batch, the rotary tables, gradients in flight in the backward) is "temporaries". Planned
(``planned_categories``): the planner's breakdown terms, mapped to the same categories
(``PLANNED``). Both sides add up to their tensor peaks.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from yatrain.plan import LiveTensorTracker
from yatrain.recipe.config import Recipe
from yatrain.runtime.process import Runtime
from yatrain.sharding import ShardableModel, ShardedEngine
from yatrain.train.metrics import StepMeter

MASTER = "master shards"
GATHER = "gather buffers"
GRADIENT = "gradient buffers"
OPTIMIZER = "optimizer state"
ACTIVATIONS = "activations"
HEAD = "head and loss"
TEMPORARIES = "temporaries"
CATEGORIES = (MASTER, GATHER, GRADIENT, OPTIMIZER, ACTIVATIONS, HEAD, TEMPORARIES)

# The planner's breakdown terms (``plan.memory.plan_for_layers``) by category. Terms that do
# not map one to one are put in the nearest category, as noted.
PLANNED = {
    "master_weights": MASTER,
    "optimizer_state": OPTIMIZER,
    # one process in bf16 computes from a bf16 copy of its shard: its gathered weights (the
    # engine's gather "buffers" are views of it)
    "compute_copy": GATHER,
    "gather_buffers": GATHER,
    "gradient_buffers": GRADIENT,  # with the norm group's fp32 gradient shard
    "gradients": GRADIENT,  # the units' fp32 gradient shards
    # the batch's token ids and the rotary tables: made outside every module, by no engine
    "batch_and_rope": TEMPORARIES,
    # made by the model's forward (under context parallelism in its first layer's) and kept
    # through the micro-batch, as activations are
    "attention_masks": ACTIVATIONS,
    "activations": ACTIVATIONS,  # the final norm's saved tensors included
    "logits_and_loss": HEAD,
    "head_gradient": HEAD,  # computed in the head's forward, with its loss
    # gradients in flight inside a layer's backward: allocated by no module's forward
    "backward_workspace": TEMPORARIES,
}
NOT_TENSORS = {"runtime_allowance"}  # in the breakdown, not in the tensor peak


def planned_categories(breakdown: dict[str, int]) -> dict[str, int]:
    """The planner's tensor peak by category (a term ``PLANNED`` does not know counts as a
    temporary: the totals still agree, and the table shows where it went)."""
    totals = dict.fromkeys(CATEGORIES, 0)
    for term, nbytes in breakdown.items():
        if term not in NOT_TENSORS:
            totals[PLANNED.get(term, TEMPORARIES)] += nbytes
    return totals


def side_by_side(tracked: dict[str, int], breakdown: dict[str, int]) -> dict[str, dict[str, int]]:
    """Each category: its tracked bytes at the peak, the planner's (``breakdown``'s terms
    mapped), and the difference."""
    planned = planned_categories(breakdown)
    return {
        name: {
            "tracked_bytes": tracked.get(name, 0),
            "planned_bytes": planned[name],
            "difference_bytes": tracked.get(name, 0) - planned[name],
        }
        for name in CATEGORIES
    }


def by_category(counted: dict[str, int]) -> dict[str, int]:
    """A tracker's ``peak_by_category`` in ``CATEGORIES`` order, every one present."""
    totals = dict.fromkeys(CATEGORIES, 0)
    for category, nbytes in counted.items():
        totals[category if category in totals else TEMPORARIES] += nbytes
    return totals


def engine_tensors(engine: ShardedEngine) -> dict[str, list[torch.Tensor]]:
    """The tensors the engine keeps for the run, by category (order matters: a storage
    that is two things, e.g. one process's gather "buffer" that is its master shard, is the
    first). The fp32 gradient shards exist only within a step: ``gradient_shards``."""
    shards, buffers = engine.shards, engine.buffers
    gradients = [slot.data for slot in buffers.slot_of if slot is not None]
    gradients += [buffers.small_grad, shards.small_grad]
    if buffers.small_out is not None:
        gradients.append(buffers.small_out)
    if buffers.reducer is not None:
        gradients += [buffers.reducer.staging, buffers.reducer.out]
    gathers = [buffer.data for buffer in buffers.buffer_of] + [buffers.small_buffer]
    copies = [t for t in (shards.compute, shards.small_compute) if t is not None]
    return {
        MASTER: [shards.master, shards.small_master],
        GRADIENT: gradients,
        GATHER: gathers + copies,
    }


def gradient_shards(engine: ShardedEngine) -> list[torch.Tensor]:
    """The units' fp32 gradient shards alive now (from a unit's first reduction in a step
    to ``after_step``)."""
    return [p.grad for p in engine.owned_params if p.grad is not None]


def optimizer_state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor the optimizer keeps per parameter (moments, momentum, step counts)."""
    held = [value for state in optimizer.state.values() for value in state.values()]
    return [value for value in held if isinstance(value, torch.Tensor)]


@contextlib.contextmanager
def module_categories(tracker: LiveTensorTracker, model: ShardableModel) -> Iterator[None]:
    """While open, what the model's forward allocates (its units', its norms', and its own:
    the attention masks) counts as activations, a checkpointed layer's recompute in the
    backward too (it runs the layer again); the output head's (the last unit: the fused
    loss and its gradients) as head and loss."""
    units = list(model.units())
    modules = [(cast(nn.Module, model), ACTIVATIONS)]
    modules += [(unit, ACTIVATIONS) for unit in units[:-1]] + [(units[-1], HEAD)]
    modules += [(norm, ACTIVATIONS) for norm in model.norm_modules()]
    outer: list[str] = []

    def enter(category: str) -> Callable[[nn.Module, object], None]:
        def pre(module: nn.Module, args: object) -> None:
            outer.append(tracker.category)
            tracker.category = category

        return pre

    def leave(module: nn.Module, args: object, out: object) -> None:
        tracker.category = outer.pop()  # also when a recompute stops early (always_call)

    handles = []
    for module, category in modules:
        handles.append(module.register_forward_pre_hook(enter(category)))
        handles.append(module.register_forward_hook(leave, always_call=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@dataclass
class TrackedPeak:
    """The tracked step's peak: where the step stood (``moment_name``) and its bytes by
    category (``CATEGORIES`` order)."""

    moment: str
    categories: dict[str, int]


def where_now(engine: ShardedEngine, tracker: LiveTensorTracker, stepping: bool) -> tuple:
    """Where the step stands (the tracker asks at each new peak): the engine's phase, unit,
    that unit's phase, micro-batch and micro-batch count, the module category running, and
    whether the optimizer is stepping."""
    s = engine.step_state
    unit_phase = s.unit_phase[s.unit] if s.unit is not None else None
    return (
        s.phase,
        s.unit,
        unit_phase,
        s.micro_batches,
        s.expected_micro_batches,
        tracker.category,
        stepping,
    )


def moment_name(where: tuple | None, n_units: int, checkpointed: int) -> str:
    """A ``where_now`` in the planner's words (``plan.activations.activation_peak``'s moments:
    loss, backward of layer i, recompute of layer j, gradient norm, a Muon run's optimizer
    step) where it is one."""
    if where is None or where[0] == "idle" or where[1] is None:
        return "between steps"
    phase, unit, unit_phase, micro_batch, micro_batches, category, stepping = where
    name = "the embedding" if unit == 0 else f"layer {unit - 1}"
    name = "the head" if unit == n_units - 1 else name
    if phase == "forward":
        what = "loss" if category == HEAD else f"forward of {name}"
    elif unit == 0 and unit_phase == "done":  # after the backward
        what = "optimizer step" if stepping else "gradient norm"
    elif 0 < unit < n_units - 1 and unit - 1 < checkpointed:
        what = f"recompute of {name}"  # a checkpointed layer's backward follows its recompute
    else:
        what = f"backward of {name}"
    many = micro_batches is not None and micro_batches > 1
    return f"{what}, micro-batch {micro_batch} of {micro_batches}" if many else what


class CategoryMeter(StepMeter):
    """The loop's meter; its counted step (``tensor_step``, run eagerly) also sorts the live
    bytes into ``CATEGORIES`` and keeps them and the moment at its peak (``tracked_peak``)."""

    def __init__(
        self,
        recipe: Recipe,
        runtime: Runtime,
        tokens_per_step: int,
        tensor_step: int,
        engine: ShardedEngine,
        model: ShardableModel,
        optimizer: torch.optim.Optimizer,
    ) -> None:
        super().__init__(recipe, runtime, tokens_per_step, tensor_step, engine)
        self.engine, self.model, self.optimizer = engine, model, optimizer
        layers = recipe.sharding.activation_checkpoint_layers  # the dry run resolved ``auto``
        self.checkpointed = layers if isinstance(layers, int) else 0
        self.tracked_peak = TrackedPeak("not counted", dict.fromkeys(CATEGORIES, 0))

    @contextlib.contextmanager
    def watching_tensors(self, step: int) -> Iterator[None]:
        """As ``StepMeter.watching_tensors``, sorting (see the module docstring)."""
        if step != self.tensor_step:
            yield
            return
        engine = self.engine
        stepping = [False]  # the optimizer's step has begun
        tracker = LiveTensorTracker(
            self.device,
            category=TEMPORARIES,
            where=lambda: where_now(engine, tracker, stepping[0]),
        )

        def before_step(*_: object) -> None:  # the gradient shards are all alive then
            tracker.classify(gradient_shards(engine), GRADIENT)
            stepping[0] = True

        hook = self.optimizer.register_step_pre_hook(before_step)
        eager = torch.compiler.set_stance("force_eager")
        with eager, tracker, module_categories(tracker, self.model):
            for category, tensors in engine_tensors(engine).items():
                tracker.adopt(tensors, category)
            tracker.adopt(optimizer_state(self.optimizer), OPTIMIZER)
            tracker.adopt(o for o in gc.get_objects() if _owns_storage(o))
            tracker.reset_peak()
            try:
                yield
            finally:
                hook.remove()
        self.tensor_peak = tracker.peak
        where = cast(tuple | None, tracker.peak_where)
        moment = moment_name(where, engine.n_units, self.checkpointed)
        self.tracked_peak = TrackedPeak(moment, by_category(tracker.peak_by_category))


def _owns_storage(value: object) -> bool:
    """As the meter counts: a tensor with storage of its own (a DTensor has none)."""
    return issubclass(type(value), torch.Tensor) and not isinstance(value, DTensor)
