"""One exception type for every user-facing failure.

The CLI prints ``str(error)`` as a single line and exits non-zero, so messages must name
the problem and the fix in one sentence; anything else is a bug and gets a traceback.
"""


class YatrainError(Exception):
    """A problem with the user's input (recipe, data, checkpoint, flags), not with yatrain."""


class ConfigError(YatrainError):
    """The recipe or a command-line override is invalid."""


class DataError(YatrainError):
    """The tokenized data set or its inputs are missing, corrupt or incompatible."""


class TrainingError(YatrainError):
    """Training cannot continue (a non-finite loss, a lost peer rank)."""


class LostPeer(TrainingError):
    """This rank failed only because another did (it lost contact with a peer): a launcher
    blames the other one first."""


class Interrupted(YatrainError):
    """Stopped on SIGTERM/SIGINT after saving a checkpoint; resumable. ``by_another``: the
    signal reached another rank, not this one (a launcher names that one)."""

    def __init__(self, message: str, by_another: bool = False) -> None:
        super().__init__(message)
        self.by_another = by_another
