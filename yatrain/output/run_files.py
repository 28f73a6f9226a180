"""A resumed run's files: ``metrics.jsonl`` trimmed to the step it continues from, and an
earlier ``config.yaml`` (or metrics of a run that never saved) kept aside, never lost."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from yatrain.files import write_whole
from yatrain.output.record import parse_record


@dataclass
class Trimmed:
    """What resuming did to ``metrics.jsonl``: kept aside (a run that never saved), or the
    lines it left out because they were not records (torn, not UTF-8, not an object)."""

    kept_aside: Path | None = None
    dropped: list[tuple[int, str]] = field(default_factory=list)  # (line number, why)

    def notes(self, path: Path, last_step: int) -> list[str]:
        """What to tell the user, one line each."""
        if self.kept_aside is not None:
            return [
                f"{path.parent} had metrics but no checkpoint: kept them as {self.kept_aside.name}"
            ]
        return [
            f"{path} line {number} is not a metrics record ({why}): left it out; "
            f"continuing from the checkpoint at step {last_step}"
            for number, why in self.dropped
        ]


def truncate_metrics(path: Path, last_step: int) -> Trimmed:
    """Drop records after the resumed step so the file reads as one uninterrupted run, and
    any line that is not a record (a crash's torn tail, damage): each is named in the result.

    Starting from step 0 over an existing file (a run that died before its first
    checkpoint) keeps the old file under a new name instead."""
    if not path.exists():
        return Trimmed()
    if last_step == 0:
        return Trimmed(kept_aside=keep_aside(path))
    trimmed, kept = Trimmed(), []
    for number, line in enumerate(path.read_bytes().split(b"\n"), 1):
        if not line.strip():
            continue
        try:
            record = parse_record(line)
        except ValueError as why:
            trimmed.dropped.append((number, str(why)))
            continue
        if record.step <= last_step:
            kept.append(line + b"\n")
    write_whole(path, b"".join(kept))
    return trimmed


def keep_aside(path: Path) -> Path:
    """Rename ``path`` to ``NAME-before-restart-N.EXT`` (the first free N); returns it."""
    number = 1
    while (kept := path.with_name(f"{path.stem}-before-restart-{number}{path.suffix}")).exists():
        number += 1
    os.replace(path, kept)
    return kept


def write_config(path: Path, text: str) -> Path | None:
    """Write a run's ``config.yaml`` (whole or not at all); a different one already there is
    kept aside first (returns its new name)."""
    kept = None
    if path.exists() and path.read_text(errors="replace") != text:
        kept = keep_aside(path)
    write_whole(path, text)
    return kept
