"""A resumed run's metrics: ``metrics.jsonl`` trimmed to the step it continues from."""

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
