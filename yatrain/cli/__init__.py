"""The ``yatrain`` command line: thin wrappers that turn flags into library calls.

User errors (``YatrainError``), a full or read-only disk (``OSError`` ENOSPC, EDQUOT,
EROFS, EACCES), a path the file system refuses (ENAMETOOLONG) and any other ``OSError``
that names its path (a directory where a file belongs, a file where a directory does)
become one line on stderr and exit code 2; ``--debug`` shows the traceback
instead. Anything else is a bug and keeps its traceback.

Each command lives in the module of its concept (``data``, ``train``, ``checkpoints``) and
registers itself on the one Typer ``app`` (``app.py``); importing them here builds the
command, in the order ``--help`` lists them. They import the library (and torch) inside each
command, so ``--help``, a mistyped command or a bad flag answer without torch.
"""

from __future__ import annotations

import errno
import os
import sys

from typer import Abort
from typer._click.exceptions import NoArgsIsHelpError, UsageError  # typer exports no other name

from yatrain.runtime.compile_cache import protect_process

# Before any import of torch: inductor creates its cache where the variable points the
# moment it is imported (runtime/compile_cache.py), and every command imports it.
protect_process()

# isort: split
from yatrain.cli import data, train  # noqa: E402  (registered in the order --help lists them)

# isort: split
from yatrain.cli import checkpoints  # noqa: E402
from yatrain.cli.app import app  # noqa: E402
from yatrain.errors import Interrupted, LostPeer, YatrainError  # noqa: E402
from yatrain.runtime.launcher_link import die_with_launcher, launched, tell_launcher  # noqa: E402

__all__ = ["app", "checkpoints", "data", "main", "train"]


# What the machine's file system can refuse (not a bug): full, over quota, read-only, denied.
_DISK_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}
_USER_OS_ERRORS = _DISK_ERRORS | {errno.ENAMETOOLONG}  # a path the user typed


def main() -> None:
    die_with_launcher()  # a rank of a launcher that is killed ends too
    debug = "--debug" in sys.argv
    try:
        code = app(prog_name="yatrain", standalone_mode=False)
    except NoArgsIsHelpError as help_text:
        help_text.show()
        sys.exit(2)
    except UsageError as error:  # a flag's value out of range, a missing argument, ...
        command = error.ctx.command_path if error.ctx is not None else "yatrain"
        message = error.format_message().replace("\n", " ")
        print(f"yatrain: error: {message} (see {command} --help)", file=sys.stderr)
        sys.exit(2)
    except Abort:
        sys.exit(1)
    except Interrupted as stopped:
        print(f"yatrain: {stopped}", file=sys.stderr)
        tell_launcher(str(stopped), 130, follows_another=stopped.by_another)  # a clean stop
        sys.exit(130)
    except (YatrainError, OSError) as error:
        if debug or (isinstance(error, OSError) and not _about_a_path(error)):
            raise
        rank = os.environ.get("RANK")
        named = rank is not None and os.environ.get("WORLD_SIZE") and launched()
        where = f" (rank {rank})" if named else ""  # stale variables name no rank
        print(f"yatrain: error{where}: {_one_line(error)}", file=sys.stderr)
        tell_launcher(_one_line(error), 2, follows_another=isinstance(error, LostPeer))
        sys.exit(2)
    except KeyboardInterrupt:
        code = 130
    if code == 130:  # typer turns Ctrl-C (or SIGTERM made one) into exit code 130
        print("yatrain: interrupted", file=sys.stderr)
    sys.exit(code if isinstance(code, int) else 0)


def _about_a_path(error: OSError) -> bool:
    """An error of the disk, or of a path it names (what was there), not of yatrain."""
    return error.errno in _USER_OS_ERRORS or bool(error.filename)


def _one_line(error: BaseException) -> str:
    if isinstance(error, OSError) and error.errno == errno.ENAMETOOLONG:
        return (
            f"{error.strerror}: {error.filename} (each part of a path is limited to 255 "
            "bytes): use a shorter name"
        )
    if isinstance(error, OSError):
        where = f": {error.filename}" if error.filename else ""
        if error.errno not in _DISK_ERRORS:
            return f"{error.strerror or error}{where}: move it away or pass another path"
        return f"{error.strerror or error}{where}; free space or fix permissions, then rerun"
    return str(error)
