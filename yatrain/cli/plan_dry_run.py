"""``yatrain plan --dry-run``'s flags and its printing (the run itself: ``yatrain.dry_run``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from yatrain.recipe.config import Recipe

DRY_RUN = typer.Option(
    False,
    "--dry-run",
    help="Run the real engine and loop as one rank of --gpus fake ranks on fake tensors, "
    "and hold its tracked tensor peak against the plan (docs/planner.md#dry-run).",
)
DRY_RANK = typer.Option(0, "--rank", min=0, help="With --dry-run: the rank this process is.")
DRY_STEPS = typer.Option(2, "--steps", min=2, help="With --dry-run: steps to run (at least 2).")


def print_dry_run(
    recipe: Path,
    loaded: Recipe,
    gpus: int,
    limit: int | None,
    allowance: int | None,
    rank: int,
    steps: int,
    as_json: bool,
) -> None:
    """Run the dry run (``yatrain.dry_run``) and print its report or one JSON object."""
    from yatrain.common import dumps_json
    from yatrain.dry_run import dry_run, format_dry_run

    result = dry_run(
        loaded, recipe.name, gpus, rank=rank, steps=steps, gpu_memory=limit, allowance=allowance
    )
    typer.echo(dumps_json(result.to_json()) if as_json else format_dry_run(result))
