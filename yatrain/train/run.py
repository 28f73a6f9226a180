"""What a run is, as the loop sees it: its parts (``Run``), and what it holds open
(``Opened``), closed on any exit through one path. ``setup`` builds it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from yatrain.context_parallel.split import ContextParallel
from yatrain.data import BatchLoader
from yatrain.output.loggers import Loggers
from yatrain.recipe.config import Recipe
from yatrain.recipe.topology import JobLayout
from yatrain.runtime.process import Runtime
from yatrain.runtime.watchdog import Watchdog
from yatrain.sharding import ShardedEngine
from yatrain.train.checkpointer import Checkpointer
from yatrain.train.evaluate import Evaluator
from yatrain.train.metrics import StepMeter
from yatrain.train.profile import StepProfiler
from yatrain.train.rundir import RunDirLock

if TYPE_CHECKING:  # imported by a compiled run only (setup.compile_watch)
    from yatrain.runtime.compile import CompileWatch


@dataclass
class Opened:
    """What a run holds open, each part added as it opens; ``close`` is the one close path,
    for a run that started and for one that failed to."""

    loggers: Loggers
    watchdog: Watchdog
    lock: RunDirLock | None
    checkpointer: Checkpointer | None = None
    compiler: CompileWatch | None = None  # train.compile: counts and times compilations

    def close(self, started: bool = True) -> None:
        """A background save completed, the loggers (a W&B run, metrics.jsonl) closed, the
        watchdog and the compile watch stopped, the run directory unlocked (and, if the run
        never started, left as it was found)."""
        if (checkpointer := self.checkpointer) is not None:
            if (writing := checkpointer.writing) is not None:
                self.watchdog.phase(f"the background write of checkpoint step-{writing}")
            checkpointer.close(self.loggers.say)
        self.watchdog.close()
        self.loggers.close()
        if self.compiler is not None:
            self.compiler.close()
        if self.lock is not None:
            self.lock.release(started=started)


@dataclass
class Run:
    """One training run as the loop sees it."""

    recipe: Recipe
    runtime: Runtime
    layout: JobLayout
    run_dir: Path
    loader: BatchLoader
    model: nn.Module
    engine: ShardedEngine
    optimizer: torch.optim.Optimizer
    meter: StepMeter
    profiler: StepProfiler
    evaluator: Evaluator
    opened: Opened  # the loggers, watchdog, lock, checkpointer and compile watch
    context: ContextParallel | None = None  # sharding.context_parallel > 1
    start_step: int = 0
    skipped_steps: int = 0
    step_number: int = field(default=0)  # the step being run (for messages)

    @property
    def loggers(self) -> Loggers:
        return self.opened.loggers

    @property
    def watchdog(self) -> Watchdog:
        return self.opened.watchdog

    @property
    def lock(self) -> RunDirLock | None:
        return self.opened.lock

    @property
    def checkpointer(self) -> Checkpointer:
        assert self.opened.checkpointer is not None  # a started run has one
        return self.opened.checkpointer

    @property
    def compiler(self) -> CompileWatch | None:
        return self.opened.compiler

    def close(self) -> None:
        self.opened.close(started=True)
