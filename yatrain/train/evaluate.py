"""Held-out loss: the ``Evaluator`` the loop asks at every step (``due``), also used by
``yatrain eval``.

``val_loss`` is the mean next-token cross-entropy over every predicted token of the first
``eval.batches x data.global_batch_size`` windows of the held-out stream (``data.heldout``):
each rank sums the losses and counts the tokens of its slice in fp32 per micro-batch and
float64 across them, and one all-reduce adds them up, so the value is the same at any world
size. A mixture is evaluated source by source (``val_loss/NAME``); its overall loss weighs
each source's loss by its mixture weight. The forward passes run without gradients through
the same model and engine hooks as training, between two steps, and read nothing the
training depends on (no random numbers, not the training loader).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from yatrain.common import IGNORE_INDEX
from yatrain.context_parallel.split import ContextParallel
from yatrain.data.batch import MicroBatch
from yatrain.data.heldout import (
    EvalWindows,
    attention_inputs,
    check_same_tokenizer,
    held_out_data,
)
from yatrain.recipe.config import Recipe
from yatrain.recipe.topology import JobLayout
from yatrain.runtime.host_reads import host_read
from yatrain.runtime.process import Runtime
from yatrain.train.step import prepare_micro_batch


@dataclass(frozen=True)
class Evaluation:
    """One evaluation's result (over all ranks)."""

    loss: float
    tokens: int  # predicted tokens evaluated
    windows: int
    seconds: float
    by_source: dict[str, float] = field(default_factory=dict)  # a mixture's sources

    @property
    def ppl(self) -> float | None:
        """exp(loss); None where it is not a finite number."""
        return math.exp(self.loss) if math.isfinite(self.loss) and self.loss < 700 else None

    def record_fields(self) -> dict:
        """The fields a ``MetricsRecord`` carries at an evaluation step."""
        return {
            "val_loss": self.loss,
            "val_ppl": self.ppl,
            "val_tokens": self.tokens,
            "val_sources": dict(self.by_source),
        }


class Evaluator:
    """When to evaluate (``due``) and how (``evaluate``, collective: every rank calls it at
    the same steps and runs the same number of forward passes)."""

    def __init__(
        self,
        recipe: Recipe,
        parts: list[EvalWindows],
        device: torch.device,
        *,
        enabled: bool = True,
        context: ContextParallel | None = None,
    ) -> None:
        self.every, self.at_end = recipe.eval.every, recipe.eval.at_end
        self.total_steps = recipe.train.steps
        self.parts, self.device = parts, device
        self.context = context  # context parallelism: each rank evaluates its chunks
        self.enabled = enabled and bool(parts)

    @classmethod
    def disabled(cls, recipe: Recipe, device: torch.device) -> Evaluator:
        return cls(recipe, [], device, enabled=False)

    def due(self, step: int, stopping: bool = False) -> bool:
        """Evaluate after this step? Every ``eval.every`` steps and, with ``eval.at_end``,
        after the last; never while the run is stopping on a signal."""
        if not self.enabled or stopping:
            return False
        periodic = self.every > 0 and step % self.every == 0
        return periodic or (self.at_end and step == self.total_steps)

    def describe(self) -> str:
        """What an evaluation reads, in words."""
        return "; ".join(
            f"{p.held.describe()}: {p.windows:,} windows of {p.seq_len}+1 tokens"
            for p in self.parts
        )

    def schedule(self) -> str:
        """One line for the run's log: when it evaluates, on what."""
        when = f"every {self.every} steps" if self.every else "after the last step"
        end = " and after the last" if self.at_end and self.every else ""
        return f"eval {when}{end} on {self.describe()}"

    def short_notices(self) -> list[str]:
        """What to say once when a held-out stream is shorter than an evaluation asks."""
        return [
            f"held-out data {p.held.describe()} has {p.available:,} windows of {p.seq_len}+1 "
            f"tokens, fewer than the {p.requested:,} an evaluation asks for (eval.batches x "
            f"data.global_batch_size): each evaluation uses all {p.available:,}"
            for p in self.parts
            if p.short
        ]

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> Evaluation:
        """The held-out loss of ``model`` as it is now (see the module docstring)."""
        start = time.perf_counter()
        sums = torch.zeros(len(self.parts), 2, dtype=torch.float64, device=self.device)
        for index, part in enumerate(self.parts):
            for batch in part.micro_batches():
                sums[index] += self._loss_and_count(model, batch)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(sums)
        totals = host_read(sums.tolist)
        losses = [loss / max(count, 1.0) for loss, count in totals]
        weights = [p.held.weight for p in self.parts]
        overall = sum(w * loss for w, loss in zip(weights, losses, strict=True)) / sum(weights)
        by_source = (
            {p.held.name: loss for p, loss in zip(self.parts, losses, strict=True)}
            if len(self.parts) > 1
            else {}
        )
        return Evaluation(
            loss=overall,
            tokens=int(sum(count for _, count in totals)),
            windows=sum(p.windows for p in self.parts),
            seconds=time.perf_counter() - start,
            by_source=by_source,
        )

    def _loss_and_count(self, model: nn.Module, batch: MicroBatch) -> torch.Tensor:
        """[summed loss, predicted tokens] of one micro-batch, in float64."""
        inputs, targets, extra = prepare_micro_batch(batch, self.device, self.context)
        # The model's fused, chunked loss (as in training): no logits for every token. It is
        # the mean over predicted tokens (IGNORE_INDEX targets are padding).
        mean = model(inputs, **extra, targets=targets)
        count = (targets != IGNORE_INDEX).sum()
        return torch.stack([mean.double() * count.double(), count.double()])


def build_evaluator(
    recipe: Recipe,
    runtime: Runtime,
    layout: JobLayout,
    tokenizer: tuple[str, int, int],
    *,
    data_dir: Path | None = None,
    force: bool = False,
    context: ContextParallel | None = None,
) -> Evaluator:
    """The run's evaluator, checked at start-up (held-out data exists, holds at least one
    window and was made with ``tokenizer`` = (sha256, BOS, EOS)); a disabled one when the
    recipe does not evaluate, unless ``force`` (``yatrain eval``). Each rank reads its
    data rank's windows (``layout``); under ``context`` parallelism a CP group's ranks
    evaluate their chunks of them."""
    if not (force or recipe.evaluates):
        return Evaluator.disabled(recipe, runtime.device)
    data = recipe.data
    held = held_out_data(data, data_dir)
    check_same_tokenizer(held, *tokenizer)
    requested = recipe.eval.batches * data.global_batch_size
    rank, ranks = layout.data_rank(runtime.rank), layout.data_ranks
    inputs = attention_inputs(data, tokenizer[1], tokenizer[2])
    micro = data.micro_batch_size
    parts = [EvalWindows(h, data.seq_len, requested, micro, rank, ranks, inputs) for h in held]
    return Evaluator(recipe, parts, runtime.device, context=context)
