"""What every benchmark reports with: medians and ranges, process memory, the machine's
load, and Markdown tables with pass/fail verdicts."""

from __future__ import annotations

import contextlib
import ctypes
import os
import statistics
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path

_REPO = Path(__file__).resolve().parents[2]

# ---------------------------------------------------------------------------- statistics


def median(values: Iterable[float]) -> float:
    values = list(values)
    return statistics.median(values) if values else float("nan")


def spread(values: Sequence[float]) -> str:
    """``min..max`` of a sample, for showing how noisy a median is."""
    if not values:
        return "n/a"
    return f"{min(values):.3f}..{max(values):.3f}"


def load_average() -> str:
    """The 1-minute load average: how busy the machine was (other work skews timings)."""
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except OSError:
        return "n/a"


# ---------------------------------------------------------------------------- CPU memory


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_bytes() -> int | None:
    """Resident set size of this process now."""
    kib = _status_kib("VmRSS")
    return None if kib is None else kib * 1024


def hwm_bytes() -> int | None:
    """Resident high-water mark since the last :func:`reset_hwm` (or process start)."""
    kib = _status_kib("VmHWM")
    return None if kib is None else kib * 1024


def trim_heap() -> None:
    """Hand free malloc memory back to the OS (glibc), so a baseline RSS is not inflated by
    what earlier, already freed allocations left behind."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def reset_hwm() -> bool:
    """Reset VmHWM to the current RSS (Linux: write 5 to /proc/self/clear_refs)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


# ---------------------------------------------------------------------------- printing


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub-markdown table (pastes straight into a result file under docs/benchmarks/)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cells[0]), rule, *(line(r) for r in cells[1:])])


def verdict(value: float | None, limit: float, *, at_most: bool = True) -> str:
    if value is None or value != value:  # None or NaN
        return "n/a"
    ok = value <= limit if at_most else value >= limit
    return "PASS" if ok else "FAIL"


# ---------------------------------------------------------------------------- baselines


def yatrain_at(revision: str, into: Path) -> Path:
    """The ``yatrain`` package of git ``revision``, extracted into the new folder ``into``
    (put it first on a child process's path to measure that revision beside this tree)."""
    archive = subprocess.run(
        ["git", "archive", revision, "yatrain"], cwd=_REPO, check=True, capture_output=True
    ).stdout
    into.mkdir()
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into
