"""The ``yatrain`` command line: thin wrappers that turn flags into library calls.

User errors (``YatrainError``) and a full or read-only disk (``OSError`` ENOSPC, EDQUOT,
EROFS, EACCES) become one line on stderr and exit code 2; ``--debug`` shows the traceback
instead. Anything else is a bug and keeps its traceback.

Each command lives in the module of its concept (``data``, ``train``, ``checkpoints``) and
registers itself on the one Typer ``app`` (``app.py``); importing them here builds the
command, in the order ``--help`` lists them.
"""

from __future__ import annotations

import errno
import os
import sys

from yatrain.cli import data, train  # registered in the order --help lists them

# isort: split
from yatrain.cli import checkpoints
from yatrain.cli.app import app
from yatrain.errors import Interrupted, YatrainError

__all__ = ["app", "checkpoints", "data", "main", "train"]


# What the machine's file system can refuse (not a bug): full, over quota, read-only, denied.
_DISK_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}


def main() -> None:
    debug = "--debug" in sys.argv
    try:
        app(prog_name="yatrain")
    except Interrupted as stopped:
        print(f"yatrain: {stopped}", file=sys.stderr)
        sys.exit(130)
    except (YatrainError, OSError) as error:
        if debug or (isinstance(error, OSError) and error.errno not in _DISK_ERRORS):
            raise
        rank = os.environ.get("RANK")
        where = f" (rank {rank})" if rank is not None and os.environ.get("WORLD_SIZE") else ""
        print(f"yatrain: error{where}: {_one_line(error)}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("yatrain: interrupted", file=sys.stderr)
        sys.exit(130)


def _one_line(error: BaseException) -> str:
    if isinstance(error, OSError):
        where = f": {error.filename}" if error.filename else ""
        return f"{error.strerror or error}{where}; free space or fix permissions, then rerun"
    return str(error)
