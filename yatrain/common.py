"""The small vocabulary every layer shares: dtype names and byte sizes, how sizes print,
strict JSON, and the target that adds no loss.

A recipe names dtypes as ``"bf16"`` / ``"fp32"``; the loop, the planner, export and the
benchmarks all turn those names into torch dtypes and byte counts here, so a third dtype
would be added in one place.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}

KIB, MIB, GIB = 2**10, 2**20, 2**30

# A target that adds no loss (F.cross_entropy's default ignore_index): the held-out data pads
# with it and the model's loss skips it.
IGNORE_INDEX = -100
_UNITS = {"GiB": GIB, "MiB": MIB, "KiB": KIB}


def dtype_bytes(name: str) -> int:
    """Bytes per element of a dtype named as in recipes (``"bf16"`` -> 2)."""
    return DTYPES[name].itemsize


def format_bytes(
    n: float | None, unit: str | None = None, *, digits: int = 2, suffix: bool = True
) -> str:
    """``n`` bytes as text in ``unit`` (GiB, MiB or KiB), or in the largest unit that keeps
    the number at least 1 (plain bytes below 1 KiB); ``"n/a"`` when nothing was measured.
    ``suffix=False`` leaves the unit off, for a column whose header names it."""
    if n is None:
        return "n/a"
    if unit is None:
        unit = next((name for name, scale in _UNITS.items() if abs(n) >= scale), "B")
    number = f"{n:.0f}" if unit == "B" else f"{n / _UNITS[unit]:.{digits}f}"
    return f"{number} {unit}" if suffix else number


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float (NaN, inf) replaced by None, recursively: JSON
    has no NaN, and a file we write must parse with any strict JSON reader."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(item) for item in value]
    return value


def dumps_json(value: Any, **options: Any) -> str:
    """Strict JSON text (``null`` for non-finite numbers, never a bare ``NaN``)."""
    return json.dumps(json_safe(value), allow_nan=False, **options)
