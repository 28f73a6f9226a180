"""TensorBoard: the records' fields as scalars in ``RUN_DIR/tensorboard``, for machines that
reach no W&B server (an air-gapped cluster) or people who prefer it.

``logging.tensorboard: true`` turns it on; the ``tensorboard`` package is an optional extra
(``pip install 'yatrain[tensorboard]'``), checked on every rank before anything is built
(``require_tensorboard``), so a missing package is one error line, not a run that dies on
rank 0 after the others started. Only rank 0 writes, through ``torch.utils.tensorboard``.
"""

from __future__ import annotations

import importlib.util
import math
import tempfile
from pathlib import Path

from yatrain.errors import ConfigError
from yatrain.output.record import MetricsRecord
from yatrain.recipe.config import Recipe
from yatrain.runtime.run_paths import own_folder


def require_tensorboard(recipe: Recipe) -> None:
    """Refuse ``logging.tensorboard`` without the package (before anything is built)."""
    if recipe.logging.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(
            "logging.tensorboard is true but the tensorboard package is not installed: "
            "pip install 'yatrain[tensorboard]', or set logging.tensorboard=false"
        )


class TensorBoardLogger:
    """Every numeric field of a record at its step (what W&B gets); the summary's numbers
    as ``summary/NAME`` at the last step. A resumed run (``start_step`` > 0) purges what an
    earlier attempt logged after that step, as ``metrics.jsonl`` is trimmed."""

    def __init__(self, run_dir: Path, start_step: int = 0) -> None:
        from torch.utils.tensorboard import SummaryWriter  # optional: imported when used

        folder = writable_folder(run_dir / "tensorboard")
        purge = start_step + 1 if start_step > 0 else None
        self.writer = SummaryWriter(log_dir=str(folder), purge_step=purge)
        self.last_step = 0

    def log(self, record: MetricsRecord) -> None:
        for name, value in scalars(record.to_json()).items():
            self.writer.add_scalar(name, value, global_step=record.step)
        self.writer.flush()  # a run in progress shows up at once
        self.last_step = record.step

    def summary(self, summary: dict) -> None:
        for name, value in scalars(summary).items():
            self.writer.add_scalar(f"summary/{name}", value, global_step=self.last_step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def writable_folder(folder: Path) -> Path:
    """``folder``, made if missing; one line when it is a link or a file is in the way
    (``run_paths.own_folder``), or it is read-only (TensorBoard's writer thread would fail
    later, with a traceback)."""
    try:
        own_folder(folder)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as error:
        raise ConfigError(
            f"{folder} is not writable ({error.strerror}): fix its permissions, or set "
            "logging.tensorboard=false"
        ) from None
    return folder


def scalars(fields: dict) -> dict[str, float]:
    """The fields that are finite numbers (not None, strings or booleans)."""
    return {
        k: float(v)
        for k, v in fields.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    }
