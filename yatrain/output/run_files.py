"""A resumed run's files: ``metrics.jsonl`` trimmed to the step it continues from, and an
earlier ``config.yaml`` (or metrics of a run that never saved) kept aside, never lost."""

from __future__ import annotations

import json
import os
from pathlib import Path


def truncate_metrics(path: Path, last_step: int) -> Path | None:
    """Drop records after the resumed step so the file reads as one uninterrupted run.

    Starting from step 0 over an existing file (a run that died before its first
    checkpoint) keeps the old file under a new name instead; returns that name."""
    if not path.exists():
        return None
    if last_step == 0:
        return keep_aside(path)
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


def keep_aside(path: Path) -> Path:
    """Rename ``path`` to ``NAME-before-restart-N.EXT`` (the first free N); returns it."""
    number = 1
    while (kept := path.with_name(f"{path.stem}-before-restart-{number}{path.suffix}")).exists():
        number += 1
    os.replace(path, kept)
    return kept


def write_config(path: Path, text: str) -> Path | None:
    """Write a run's ``config.yaml``; a different one already there is kept aside first
    (returns its new name)."""
    kept = None
    if path.exists() and path.read_text(errors="replace") != text:
        kept = keep_aside(path)
    path.write_text(text)
    return kept
