"""Where a run lives and where it continues from (``--resume auto|never|PATH``).

The default run directory must be the same for every rank and for every restart of an
elastic torchrun job, so under torchrun it is named after the job's rendezvous id; a plain
single-process run gets a fresh, timestamped directory.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from yatrain.errors import ConfigError


def default_run_dir(recipe_name: str) -> Path:
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id and run_id != "none":
        return Path("runs") / f"{recipe_name}-{run_id}"
    return Path("runs") / f"{recipe_name}-{time.strftime('%Y%m%d-%H%M%S')}"


def run_dir_for(resume: str, run_dir: Path | None, recipe_name: str, ckpt_dirname: str) -> Path:
    """The run directory: given, or the run that holds ``--resume PATH``, or the default."""
    if run_dir is not None:
        return run_dir
    if resume not in ("auto", "never"):
        path = Path(resume)
        if path.parent.name == ckpt_dirname:
            return path.parent.parent
    return default_run_dir(recipe_name)


def check_fresh_start_allowed(run_dir: Path, resume: str) -> None:
    if resume == "never" and (run_dir / "metrics.jsonl").exists():
        raise ConfigError(
            f"run directory {run_dir} already holds a run (metrics.jsonl) and --resume is never: "
            "pass another --run-dir, use --resume auto, or delete it"
        )


def truncate_metrics(path: Path, last_step: int) -> Path | None:
    """Drop records after the resumed step so the file reads as one uninterrupted run.

    Starting from step 0 over an existing file (a run that died before its first
    checkpoint) keeps the old file under a new name instead; returns that name."""
    if not path.exists():
        return None
    if last_step == 0:
        number = 1
        while (kept := path.with_name(f"metrics-before-restart-{number}.jsonl")).exists():
            number += 1
        os.replace(path, kept)
        return kept
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= last_step:
                kept.append(line)
        except ValueError:
            continue  # a line cut short by a crash
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(f"{line}\n" for line in kept))
    os.replace(tmp, path)
    return None
