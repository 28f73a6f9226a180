"""One optimizer step on the sharded engine: the sequence every caller shares.

The training loop, the benchmarks and the tests all step through ``train_step``, so the
order below lives in one place: forward and backward over the micro-batches (the engine
reduce-scatters each unit's gradient as soon as it is complete), ``reduce_gradients`` (wait
for the last reductions), ``clip_grad_norm_`` (exact global norm; it also averages over
ranks and micro-batches, in the same pass as the clipping), the guard (all ranks agree on
the host whether to stop, and on the device whether the step is finite), the optimizer step
with that flag (a non-finite step changes nothing: ``optim/skip.py``), the guard's
record of whether the updated weights are finite, ``after_step`` (free the gradient shards,
mark the gather buffers stale). Nothing here reads a device value: the host never waits for
the device inside a step (``runtime.host_reads``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from yatrain.context_parallel.split import ContextParallel
from yatrain.data.batch import MicroBatch
from yatrain.models.loss import LossFn, model_loss
from yatrain.optim import step_unless
from yatrain.sharding import ShardedEngine
from yatrain.train.guard import StepGuard
from yatrain.train.timing import NoClock, StepClock

# A MicroBatch, or an (inputs, targets) pair: a micro-batch without model inputs.
AnyMicroBatch = MicroBatch | tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class StepOutcome:
    """What one step measured and decided (the tensors stay on the device until read)."""

    loss: torch.Tensor  # this rank's mean loss over its micro-batches
    grad_norm: torch.Tensor  # the global gradient norm before clipping
    stop: bool = False  # a stop was requested on some rank (agreed on the host)
    skipped: torch.Tensor | None = None  # 1.0: not finite, not applied (device; guard only)


def prepare_micro_batch(
    batch: AnyMicroBatch, device: torch.device, context: ContextParallel | None = None
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(inputs, targets, the model's other arguments) on ``device``, as the model takes them:
    under ``context`` parallelism this rank's chunks of the windows (their model inputs
    were computed on the whole windows). The step and the evaluator both prepare here."""
    inputs, targets, extra = MicroBatch(*batch).to(device)
    if context is not None:
        return context.localize(inputs, targets, dict(extra))
    return inputs, targets, dict(extra)


def forward_backward(
    model: nn.Module,
    micro_batches: Sequence[AnyMicroBatch],
    device: torch.device,
    loss_fn: LossFn = model_loss,
    context: ContextParallel | None = None,
) -> torch.Tensor:
    """Forward and backward of every micro-batch; returns the sum of their losses."""
    loss_sum = torch.zeros((), device=device)
    for batch in micro_batches:
        inputs, targets, extra = prepare_micro_batch(batch, device, context)
        loss = loss_fn(model, inputs, targets, extra)
        loss.backward()
        loss_sum += loss.detach()
    return loss_sum


def train_step(
    model: nn.Module,
    engine: ShardedEngine,
    optimizer: torch.optim.Optimizer,
    micro_batches: Sequence[AnyMicroBatch],
    *,
    grad_clip: float,
    guard: StepGuard | None = None,
    loss_fn: LossFn = model_loss,
    clock: StepClock | None = None,
    context: ContextParallel | None = None,
) -> StepOutcome:
    """One optimizer step over this rank's micro-batches (see the module docstring).

    Without a guard every step is applied; with one, a non-finite step is not (the guard
    counts it on the device, and the caller reads its records at log steps). Each
    micro-batch carries its model inputs (the loader's document ids and positions;
    ``prepare_micro_batch``); ``loss_fn`` is the model's own fused loss unless a comparison
    needs the plain one (``logits_loss``); ``clock`` times the step's parts
    (``timing.StepClock``); ``context``: context parallelism (``context_parallel.split``),
    this rank's chunks of the micro-batches' windows."""
    engine.expect_micro_batches(len(micro_batches))  # hybrid: the last one starts the all-reduce
    clock = clock or NoClock()
    clock.phase("model")
    loss_sum = forward_backward(model, micro_batches, engine.device, loss_fn, context)
    engine.reduce_gradients()
    grad_norm = engine.clip_grad_norm_(grad_clip)
    clock.phase("guard")
    stop = guard.agree_on_stop() if guard is not None else False
    skip = guard.nonfinite(loss_sum, grad_norm) if guard is not None else None
    clock.phase("optimizer")
    step_unless(optimizer, skip)
    if guard is not None:
        guard.note_weights([p for group in optimizer.param_groups for p in group["params"]])
    engine.after_step()
    clock.phase(None)
    return StepOutcome(loss_sum / len(micro_batches), grad_norm, stop, skip)
