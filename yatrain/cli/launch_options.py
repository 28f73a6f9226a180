"""``yatrain pretrain``'s launcher flags (torchrun's, and two of its own: see
runtime/launch.py) and the checks a launch passes before any rank starts."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from yatrain.runtime.launch import Launch

# The launcher's options (torchrun's, and two of its own): see runtime/launch.py. Each help
# is whole sentences naming its value (the metavar), as the table shows it.
NPROC_PER_NODE = typer.Option(
    None,
    "--nproc-per-node",
    metavar="N",
    help="Start N ranks on this node, one per GPU, as torchrun does.",
)
NNODES = typer.Option(
    "1", "--nnodes", metavar="N|MIN:MAX", help="The job's nodes: N, or from MIN to MAX."
)
RDZV_ENDPOINT = typer.Option(
    None,
    "--rdzv-endpoint",
    metavar="HOST:PORT",
    help="With several nodes: where they meet, the HOST:PORT of a node all of them reach.",
)
RDZV_ID = typer.Option(
    None,
    "--rdzv-id",
    metavar="ID",
    help="With several nodes: the job's ID, the same on every node and restart.",
)
MAX_RESTARTS = typer.Option(
    0,
    "--max-restarts",
    metavar="K",
    help="After a failure, restart the ranks up to K times.",
)
RDZV_TIMEOUT = typer.Option(
    600,
    "--rdzv-timeout",
    metavar="SECONDS",
    help="With several nodes: the SECONDS they wait for each other, at most.",
)
OVERSUBSCRIBE = typer.Option(
    False,
    "--oversubscribe",
    help="On CPU, allow more ranks than max(8, 2 x cores).",
)


def check_launch(job: Launch, recipe: Path, overrides: list[str]) -> None:
    """The flags, the recipe, and the recipe against the job's world sizes (the batch
    divides, the shard group divides): one line here, before any rank starts, not one per
    rank per restart."""
    from yatrain.recipe.load import load_recipe
    from yatrain.recipe.topology import job_layout

    job.check()
    loaded = load_recipe(recipe, overrides)
    for world in sorted(set(job.world_sizes())):
        job_layout(loaded, world, job.nproc_per_node)  # what each rank will resolve
