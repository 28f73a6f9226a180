"""``yatrain sweep``'s flags and their checks, and its ``--plan-only`` form (the planner's
table and plots, no training)."""

from __future__ import annotations

import math
from pathlib import Path

import typer

from yatrain.errors import ConfigError

# Bounds of the planner's flags (plan's and sweep --plan-only's): a plan for more GPUs than
# any job has ever had, or a GPU of more than a PiB, is a typo (and would spin the planner).
MAX_GPUS = 2**20
MAX_GIB = 2**20
MIN_GPU_GIB = 0.001  # a plan for less than a MiB per GPU is a typo
MAX_DIGITS = 18  # a list item longer than this is a typo (int() refuses 4,300 digits)


def gib_flag(value: float | None, low: float) -> float | None:
    """A flag's GiB, checked here rather than by a range: NaN passes every comparison, and
    a range names only the bound it happened to test ("less than or equal to 1048576")."""
    if value is None or (math.isfinite(value) and low <= value <= MAX_GIB):
        return value
    above = " above 0" if low else ""
    raise typer.BadParameter(
        f"{value}: it must be a finite number of GiB{above}, from {low:g} to {MAX_GIB}"
    )


def comma_list(text: str, flag: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise ConfigError(f"{flag}: give a comma-separated list, e.g. 2048,4096")
    return items


def is_whole_number(text: str) -> bool:
    """ASCII digits only: ``str.isdigit`` also takes '²', which ``int`` refuses."""
    return text.isascii() and text.isdigit()


def lengths_of(text: str, flag: str = "--seq-len") -> list[int]:
    items = comma_list(text, flag)
    for item in items:
        if not is_whole_number(item) or int(item[:MAX_DIGITS]) < 1:
            raise ConfigError(f"{flag}: '{item[:40]}' is not a positive whole number")
        if len(item.lstrip("0")) > MAX_DIGITS:
            raise ConfigError(f"{flag}: '{item[:40]}...' is too large a number")
    return [int(item) for item in items]


SWEEP_OUTPUT = typer.Option(
    None,
    "--output",
    help="Sweep directory (default: runs/sweep-RECIPE-TIME); rerun with the same one to resume.",
)
SWEEP_KEEP_BATCH = typer.Option(
    False, "--keep-batch-sequences", help="Keep sequences per global batch, not tokens."
)
SWEEP_CP = typer.Option(
    "", "--context-parallel", help="Comma-separated CP sizes, e.g. 1,2,4,8 (default: the recipe's)."
)
SWEEP_PLAN_ONLY = typer.Option(
    False,
    "--plan-only",
    help="No training: the planner's table and plots (memory, checkpointed layers, CP, bytes "
    "per step) for --gpus GPUs.",
)
SWEEP_GPUS = typer.Option(
    None,
    "--gpus",
    min=1,
    max=MAX_GPUS,
    help="With --plan-only: GPUs to plan for (default: --nproc-per-node).",
)
SWEEP_GPU_MEMORY = typer.Option(
    None,
    "--gpu-memory",
    callback=lambda value: gib_flag(value, MIN_GPU_GIB),
    help="With --plan-only: GiB per GPU (default: 80).",
)


def plan_only_sweep(
    recipe: Path,
    lengths: list[int],
    sizes: list[int],
    gpus: int,
    gpu_memory: float | None,
    output: Path | None,
    keep_batch_sequences: bool,
    overrides: list[str],
) -> None:
    """``sweep --plan-only``: the planner's table and plots, no training."""
    from yatrain.recipe.load import load_recipe
    from yatrain.sweep import plan_sweep

    sizes = sizes or [load_recipe(recipe, overrides).sharding.context_parallel]
    planned = plan_sweep(
        recipe,
        lengths,
        sizes,
        gpus,
        gpu_memory_gib=gpu_memory,
        output=output,
        keep_batch_sequences=keep_batch_sequences,
        overrides=overrides,
    )
    typer.echo(planned.table)
    typer.echo(f"wrote {planned.out_dir}: {', '.join(p.name for p in planned.files)}", err=True)
