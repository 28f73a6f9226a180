"""Sequence-length sweeps: measured short runs per configuration, the planner beside them;
or the planner alone (``plan_sweep``, ``yatrain sweep --plan-only``).

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
from yatrain.sweep.planned import (
    draw_plan_plots,
    format_plan_table,
    plan_rows,
    write_plan_tables,
)
from yatrain.sweep.plots import draw_plots
from yatrain.sweep.report import format_table, log_to_wandb, memory_note, write_tables
from yatrain.sweep.run import claim_output, run_configs


@dataclass
class SweepResult:
    """What a sweep measured and where it wrote it."""

    out_dir: Path
    rows: list[dict]
    files: list[Path] = field(default_factory=list)
    wandb_mode: str = "disabled"
    table_text: str = ""  # a plan-only sweep's table (a measured one is formatted from rows)

    @property
    def table(self) -> str:
        return self.table_text or format_table(self.rows)


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
    context_parallel: Sequence[int] = (),
) -> SweepResult:
    """Measure every (sequence length, CP size, checkpoint setting) of ``recipe``.

    ``checkpoint_layers`` holds layer counts or ``"auto"`` (default: the recipe's setting);
    ``context_parallel`` CP sizes (default: the recipe's). Rerunning with the same
    ``output`` skips configurations that already finished."""
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
        list(context_parallel) or None,
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
        "context_parallel": list(context_parallel),
    }
    tables = write_tables(rows, out_dir, meta)
    plots = draw_plots(rows, out_dir, recipe.stem, memory_note(nproc_per_node))
    mode = log_to_wandb(base.logging.wandb, out_dir, rows, plots, meta, say=echo)
    return SweepResult(out_dir, rows, [*tables, *plots], mode)


def plan_sweep(
    recipe: Path,
    seq_lens: Sequence[int],
    context_parallel: Sequence[int],
    gpus: int,
    *,
    gpu_memory_gib: float | None = None,
    output: Path | None = None,
    keep_batch_sequences: bool = False,
    overrides: Sequence[str] = (),
) -> SweepResult:
    """The sweep from the planner alone (``planned``): its table, ``plan.csv``,
    ``plan.json`` and ``plan.png``; nothing trains."""
    rows, source = plan_rows(
        recipe, seq_lens, context_parallel, gpus, gpu_memory_gib, overrides, keep_batch_sequences
    )
    out_dir = output or sweep_dir_name(recipe, time.strftime("%Y%m%d-%H%M%S"))
    meta = {
        "recipe": str(recipe),
        "overrides": list(overrides),
        "gpus": gpus,
        "gpu_memory_source": source,
        "keep_batch_sequences": keep_batch_sequences,
    }
    claim_output(out_dir)  # a user's directory is refused; a link there is replaced
    files = write_plan_tables(rows, out_dir, meta)
    files.append(draw_plan_plots(rows, out_dir, recipe.stem))
    return SweepResult(out_dir, rows, files, table_text=format_plan_table(rows, gpus, source))


__all__ = ["SweepResult", "plan_sweep", "run_sweep"]
