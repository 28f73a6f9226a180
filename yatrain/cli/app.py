"""The ``yatrain`` Typer application that every command module registers on."""

from __future__ import annotations

import typer

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Pretrain Llama-class models with a YaFSDP-style sharded data-parallel engine.",
)


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show full tracebacks for errors."),
) -> None:
    """yatrain: prepare data, then pretrain a recipe on one process or under torchrun."""


def interrupt(signum: int, frame: object) -> None:
    """SIGTERM handler: stop like Ctrl-C, so that a command's cleanup runs (``main`` then
    prints one line)."""
    raise KeyboardInterrupt
