"""Sequence-length sweeps: measured short runs per configuration, the planner beside them.

``run_sweep`` is the library entry point (``yatrain sweep`` calls it): it expands the
configurations (``configs``), runs each in a fresh process (``run``), and writes the table,
CSV/JSON, plots and a W&B run (``report``, ``plots``). It sits above the training loop: it
launches ``yatrain pretrain`` and reads back its ``metrics.jsonl``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from yatrain.errors import ConfigError
from yatrain.sweep.configs import base_recipe, expand_configs, sweep_dir_name
from yatrain.sweep.plots import draw_plots
from yatrain.sweep.report import format_table, log_to_wandb, memory_note, write_tables
from yatrain.sweep.run import run_configs


@dataclass
class SweepResult:
    """What a sweep measured and where it wrote it."""

    out_dir: Path
    rows: list[dict]
    files: list[Path] = field(default_factory=list)
    wandb_mode: str = "disabled"

    @property
    def table(self) -> str:
        return format_table(self.rows)


def run_sweep(
    recipe: Path,
    seq_lens: Sequence[int],
    checkpoint_layers: Sequence[str] = (),
    *,
    steps: int = 10,
    warmup: int = 2,
    output: Path | None = None,
    keep_batch_sequences: bool = False,
    nproc_per_node: int = 1,
    overrides: Sequence[str] = (),
    echo: Callable[[str], None] = print,
) -> SweepResult:
    """Measure every (sequence length, checkpoint setting) pair of ``recipe``.

    ``checkpoint_layers`` holds layer counts or ``"auto"`` (default: the recipe's setting).
    Rerunning with the same ``output`` skips configurations that already finished."""
    if steps <= warmup:
        raise ConfigError(f"--steps {steps} leaves nothing after --warmup {warmup}; raise --steps")
    overrides = list(overrides)
    base, _ = base_recipe(recipe, overrides)
    settings = list(checkpoint_layers) or [str(base.sharding.activation_checkpoint_layers)]
    out_dir = output or sweep_dir_name(recipe, time.strftime("%Y%m%d-%H%M%S"))
    recipe_path = recipe.resolve()
    configs = expand_configs(
        recipe_path,
        overrides,
        list(seq_lens),
        settings,
        steps,
        nproc_per_node,
        keep_batch_sequences,
    )
    echo(f"sweep {out_dir}: {len(configs)} configurations x {steps} steps")
    rows = run_configs(
        recipe_path, configs, out_dir, nproc=nproc_per_node, warmup=warmup, echo=echo
    )
    meta = {
        "recipe": str(recipe),
        "overrides": overrides,
        "steps": steps,
        "warmup": warmup,
        "nproc_per_node": nproc_per_node,
        "keep_batch_sequences": keep_batch_sequences,
    }
    tables = write_tables(rows, out_dir, meta)
    plots = draw_plots(rows, out_dir, recipe.stem, memory_note(nproc_per_node))
    mode = log_to_wandb(base.logging.wandb, out_dir, rows, plots, meta, say=echo)
    return SweepResult(out_dir, rows, [*tables, *plots], mode)


__all__ = ["SweepResult", "run_sweep"]
