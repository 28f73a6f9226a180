"""The ``yatrain`` command line: thin wrappers that turn flags into library calls.

User errors (``YatrainError``) become one line on stderr and exit code 2; ``--debug``
shows the traceback instead. Anything else is a bug and keeps its traceback.

Each command lives in the module of its concept (``data``, ``train``, ``checkpoints``) and
registers itself on the one Typer ``app`` (``app.py``); importing them here builds the
command, in the order ``--help`` lists them.
"""

from __future__ import annotations

import os
import sys

from yatrain.cli import data, train  # registered in the order --help lists them

# isort: split
from yatrain.cli import checkpoints
from yatrain.cli.app import app
from yatrain.errors import Interrupted, YatrainError

__all__ = ["app", "checkpoints", "data", "main", "train"]


def main() -> None:
    debug = "--debug" in sys.argv
    try:
        app(prog_name="yatrain")
    except Interrupted as stopped:
        print(f"yatrain: {stopped}", file=sys.stderr)
        sys.exit(130)
    except YatrainError as error:
        if debug:
            raise
        rank = os.environ.get("RANK")
        where = f" (rank {rank})" if rank is not None and os.environ.get("WORLD_SIZE") else ""
        print(f"yatrain: error{where}: {error}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("yatrain: interrupted", file=sys.stderr)
        sys.exit(130)
