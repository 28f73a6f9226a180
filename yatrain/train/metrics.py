"""Throughput, MFU and memory: every number here is measured by the code that prints it.

FLOPs per token come from the model (``flops_per_token``: 6 x non-embedding weights plus
the attention term, no causal halving, recompute not counted); the device's peak FLOP/s and
peak memory from ``runtime.device`` (a data sheet or a measured matmul; the allocator or the
process's high-water mark). The tensor peak (what the planner predicts) is the allocator's
figure on CUDA; on CPU it is counted by the live-tensor tracker on one chosen step
(``tensor_step``: it slows that step, so the sweep picks a warm-up step), every tensor alive
when the step starts adopted first.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from yatrain.models.llama import flops_per_token
from yatrain.output.console import run_summary
from yatrain.output.record import MetricsRecord
from yatrain.plan import LiveTensorTracker
from yatrain.recipe.config import Recipe
from yatrain.runtime.device import PeakMemory, peak_flops, synchronize
from yatrain.runtime.host_reads import device_values, host_read
from yatrain.runtime.process import Runtime
from yatrain.runtime.stragglers import StragglerWatch, reduce_loss_and_busy, straggler_fields
from yatrain.sharding import ShardedEngine
from yatrain.train.timing import Breakdown, StepClock


class StepMeter:
    """Measures the run over logging windows and owns their cadence (``due``).

    A window runs from one logged step to the next: its step time, tokens/s, MFU and the
    step-time breakdown (``timing``: ``clock`` is what the loop hands ``train_step``) are
    window averages, its peak memory the window's peak. Time spent saving checkpoints and
    evaluating is ``exclude``-d (and reported beside the step time). Every rank measures (the
    loss and the busy times are all-reduced, one collective); only rank 0 logs."""

    def __init__(
        self,
        recipe: Recipe,
        runtime: Runtime,
        tokens_per_step: int,
        tensor_step: int | None = None,
        engine: ShardedEngine | None = None,
    ) -> None:
        self.runtime, self.device = runtime, runtime.device
        self.clock = StepClock(engine, self.device) if engine is not None else None
        self.stragglers = StragglerWatch()
        self.straggler_note: str | None = None  # the console line of the last record
        self.in_data = False
        self.tensor_step, self.tensor_peak = tensor_step, None
        self.log_every, self.total_steps = recipe.train.log_every, recipe.train.steps
        self.dtype = recipe.train.dtype
        self.tokens_per_step = tokens_per_step
        self.flops_per_token = flops_per_token(recipe.model, recipe.data.seq_len)
        self.peak_flops, self.peak_source = peak_flops(self.device, recipe.train.dtype)
        self.records: list[MetricsRecord] = []

    def start(self, first_step: int) -> None:
        """Open the first window; ``first_step`` is always logged."""
        self.first_step = first_step
        self.memory = PeakMemory(self.device)
        self.run_start = time.perf_counter()
        self.open_window()

    def open_window(self) -> None:
        """Start timing the next window (after a record is logged: logging is not step time)."""
        self.window_start, self.window_steps, self.data_wait = time.perf_counter(), 0, 0.0
        self.excluded = {"checkpoint": 0.0, "eval": 0.0, "compile": 0.0}

    def due(self, step: int) -> bool:
        """Log this step? The first, every ``train.log_every``-th, and the last."""
        return step == self.first_step or step % self.log_every == 0 or step == self.total_steps

    @contextlib.contextmanager
    def waiting_for_data(self) -> Iterator[None]:
        start = time.perf_counter()
        self.in_data = True
        yield
        self.in_data = False
        self.data_wait += time.perf_counter() - start

    def stage(self) -> str | None:
        """The part of the step running now: "data", a ``StepClock`` phase, or None."""
        if self.in_data:
            return "data"
        return self.clock.name if self.clock is not None else None

    def step_done(self) -> None:
        self.window_steps += 1

    @contextlib.contextmanager
    def watching_tensors(self, step: int) -> Iterator[None]:
        """On CPU at ``tensor_step``: count live tensors through this step (see the module
        docstring); elsewhere nothing. The tracker cannot see inside compiled code, so that
        step runs eagerly (train.compile's layers included: what it counts is the eager peak)."""
        if step != self.tensor_step or self.device.type == "cuda":
            yield
            return
        eager = torch.compiler.set_stance("force_eager")
        with eager, LiveTensorTracker(self.device) as tracker:
            tracker.adopt(o for o in gc.get_objects() if _owns_storage(o))
            tracker.reset_peak()
            yield
        self.tensor_peak = tracker.peak

    def exclude(self, seconds: float, what: str) -> None:
        """Leave ``seconds`` of ``what`` ("checkpoint", "eval", "compile") out of the current
        window."""
        self.window_start += seconds
        self.excluded[what] += seconds

    def record(
        self,
        step: int,
        loss: torch.Tensor,
        grad_norm: torch.Tensor,
        lr: float,
        bytes_sent: tuple[int, int],
        skipped_steps: int,
        val: dict | None = None,
    ) -> MetricsRecord:
        """The record of the window that ends at ``step``, with an evaluation's fields
        ``val`` at evaluation steps; collective (averages the loss over ranks). The caller
        logs it, then opens the next window."""
        host_read(lambda: synchronize(self.device))  # CUDA timers are read after it
        timed = host_read(self.clock.take) if self.clock is not None else (0.0, 0.0, 0.0)
        # compiling runs inside the model phase and is left out of the window: out of compute too
        timed = (max(0.0, timed[0] - self.excluded["compile"]), timed[1], timed[2])
        steps, data = self.window_steps, self.data_wait
        busy = (time.perf_counter() - self.window_start - timed[1] - data) / steps
        start = time.perf_counter()
        loss_value, busy_all = reduce_loss_and_busy(loss, busy, self.runtime)
        timed = (timed[0], timed[1] + time.perf_counter() - start, timed[2])  # a wait too
        window_s = time.perf_counter() - self.window_start
        fields = Breakdown.of(timed, data, window_s, steps).to_fields()
        fields.update(straggler_fields(busy_all))
        fields.update(checkpoint_s=self.excluded["checkpoint"], eval_s=self.excluded["eval"])
        self.straggler_note = self.stragglers.note(
            fields["slowest_rank"], fields["slowest_busy_s"], fields["median_busy_s"]
        )
        peak_memory = host_read(self.memory.read)
        tensors = peak_memory if self.device.type == "cuda" else self.tensor_peak
        self.tensor_peak = None
        record = MetricsRecord.measure(
            step=step,
            loss=loss_value,
            lr=lr,
            grad_norm=device_values(grad_norm)[0],
            tokens_per_step=self.tokens_per_step,
            window_s=window_s,
            window_steps=steps,
            world_size=self.runtime.world_size,
            flops_per_token=self.flops_per_token,
            peak_flops=self.peak_flops,
            peak_memory=peak_memory,
            data_wait_s=self.data_wait,
            bytes_sent=bytes_sent,
            skipped_steps=skipped_steps,
            peak_tensors=tensors,
            val=val,
            breakdown=fields,
        )
        self.records.append(record)
        return record

    def summary(self, run_dir: Path) -> dict:
        """The run's summary over every window (``report.run_summary``)."""
        wall = time.perf_counter() - self.run_start
        return run_summary(self.records, wall, run_dir, self.dtype, self.runtime.world_size)


def _owns_storage(value: object) -> bool:
    """A tensor with storage of its own: a DTensor (an asynchronous save's staged state,
    alive while the write is in flight) has none; its local tensor is counted instead."""
    return issubclass(type(value), torch.Tensor) and not isinstance(value, DTensor)
