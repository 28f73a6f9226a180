"""Where a run's records go: one fan-out to the console, ``metrics.jsonl``, W&B and
TensorBoard.

Only rank 0 logs: on every other rank each method of ``Loggers`` does nothing, so the loop
calls them unconditionally. A new destination is a class with the ``MetricsLogger``
methods, added to the list ``Loggers.open`` builds.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path
from typing import Protocol, TextIO

from tqdm import tqdm

from yatrain.output.console import format_summary, known, log_line
from yatrain.output.record import MetricsFile, MetricsRecord
from yatrain.output.run_files import truncate_metrics, write_config
from yatrain.output.tensorboard_logger import TensorBoardLogger
from yatrain.output.wandb_logger import WandbLogger
from yatrain.recipe.config import Recipe, recipe_to_dict, recipe_to_yaml
from yatrain.runtime.process import Runtime


class MetricsLogger(Protocol):
    """A destination for logged records and the end-of-run summary."""

    def log(self, record: MetricsRecord) -> None: ...

    def summary(self, summary: dict) -> None: ...

    def close(self) -> None: ...


class Console:
    """stderr: a progress bar, one line per logged step, the summary table, and notes. While
    the bar is drawn, whatever else writes to stderr (a hang report, a watchdog's line, a
    warning) goes through it too: whole lines above the bar, never glued to its line."""

    def __init__(self, progress: bool) -> None:
        self.progress = progress
        self.bar: tqdm | None = None
        self.stream: TextIO = sys.stderr

    def start(self, total_steps: int, done_steps: int) -> None:
        self.stream = sys.stderr
        self.bar = tqdm(
            total=total_steps,
            initial=done_steps,
            disable=not self.progress,
            desc="pretrain",
            unit="step",
            dynamic_ncols=True,
            file=self.stream,
        )
        if not self.bar.disable:
            sys.stderr = _AboveBar(self.stream, self.bar)

    def say(self, message: str) -> None:
        if self.bar is not None and not self.bar.disable:
            self.bar.write(message, file=self.stream)
        else:
            print(message, file=sys.stderr, flush=True)

    def step_done(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def log(self, record: MetricsRecord) -> None:
        if self.bar is not None:
            self.bar.set_postfix(loss=known(record.loss, ".4f"), mfu=f"{record.mfu:.1%}")
        self.say(log_line(record))

    def summary(self, summary: dict) -> None:
        self.say(format_summary(summary))

    def close(self) -> None:
        if isinstance(sys.stderr, _AboveBar):
            sys.stderr.release()
            sys.stderr = self.stream
        if self.bar is not None:
            self.bar.close()


class _AboveBar(io.TextIOBase):
    """stderr while a bar is drawn: text is held until its line ends, then printed above
    the bar (which is redrawn below it)."""

    def __init__(self, stream: TextIO, bar: tqdm) -> None:
        self.stream, self.bar, self.pending = stream, bar, ""

    def write(self, text: str) -> int:
        self.pending += text
        if "\n" in self.pending:
            lines, _, self.pending = self.pending.rpartition("\n")
            self.bar.write(lines, file=self.stream)
        return len(text)

    def release(self) -> None:
        """Print a last line that never ended."""
        if self.pending:
            self.bar.write(self.pending, file=self.stream)
            self.pending = ""

    def flush(self) -> None:
        self.stream.flush()

    def fileno(self) -> int:
        return self.stream.fileno()

    def isatty(self) -> bool:
        return self.stream.isatty()


class MetricsFileLogger:
    """``RUN_DIR/metrics.jsonl``, one record a line (``record.read_metrics`` reads it)."""

    def __init__(self, path: Path) -> None:
        self.file = MetricsFile(path)

    def log(self, record: MetricsRecord) -> None:
        self.file.write(record)

    def summary(self, summary: dict) -> None:
        pass  # the summary is derived from the records: nothing new to write

    def close(self) -> None:
        self.file.close()


class WandbRunLogger:
    """Weights & Biases: every record at its step, the summary as the run's summary."""

    def __init__(self, wandb: WandbLogger) -> None:
        self.wandb = wandb

    def log(self, record: MetricsRecord) -> None:
        self.wandb.log(record.to_json(), step=record.step)

    def summary(self, summary: dict) -> None:
        self.wandb.summary(summary)

    def close(self) -> None:
        self.wandb.finish()


class Loggers:
    """The one fan-out (see the module docstring); inactive off rank 0."""

    def __init__(self, runtime: Runtime, progress: bool) -> None:
        self.active = runtime.is_main
        self.console = Console(progress and self.active)
        self.destinations: list[MetricsLogger] = []
        self.wandb_mode = "disabled"

    def open(self, run_dir: Path, recipe: Recipe, start_step: int) -> None:
        """Write the resolved recipe, continue ``metrics.jsonl`` from ``start_step`` and
        start the W&B run."""
        if not self.active:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        kept = write_config(run_dir / "config.yaml", recipe_to_yaml(recipe))
        if kept is not None:
            self.say(f"{run_dir} had another config.yaml: kept it as {kept.name}")
        metrics = run_dir / "metrics.jsonl"
        for note in truncate_metrics(metrics, start_step).notes(metrics, start_step):
            self.say(note)
        wandb = WandbLogger(
            recipe.logging.wandb, run_dir, recipe_to_dict(recipe), run_dir.name, say=self.say
        )
        self.wandb_mode = wandb.mode
        self.destinations = [
            self.console,
            MetricsFileLogger(run_dir / "metrics.jsonl"),
            WandbRunLogger(wandb),
        ]
        if recipe.logging.tensorboard:
            self.destinations.append(TensorBoardLogger(run_dir, start_step))

    def say(self, message: str) -> None:
        if self.active:
            self.console.say(message)

    def start_progress(self, total_steps: int, done_steps: int) -> None:
        if self.active:
            self.console.start(total_steps, done_steps)

    def step_done(self) -> None:
        self.console.step_done()

    def log(self, record: MetricsRecord) -> None:
        for destination in self.destinations:
            destination.log(record)

    def summary(self, summary: dict) -> None:
        for destination in self.destinations:
            destination.summary(summary)

    def close(self) -> None:
        for destination in self.destinations or [self.console]:
            destination.close()
        self.destinations = []
