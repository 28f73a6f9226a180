"""A safetensors file's header, checked before any of its bytes become weights.

The format: 8 bytes of little-endian header length N, N bytes of JSON (each tensor's
``dtype``, ``shape`` and ``data_offsets`` into the data that follows, and an optional
``__metadata__`` of strings), then the data. safetensors itself rejects some malformed
files with its own exception and lets others through; a label alone decides how bytes are
read, so an F32 tensor relabelled ``I32`` loads as integers a billion times too large.
``read_header`` checks every field of every tensor and names the file and the field of
the first that is wrong, in one line; only F32, BF16 and F16 weights are accepted.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from yatrain.errors import ConfigError

WEIGHT_DTYPES = {"F32": 4, "BF16": 2, "F16": 2}  # safetensors' names, bytes per element
MAX_HEADER = 100_000_000  # safetensors' own limit on the JSON header (bytes)
METADATA = "__metadata__"


@dataclass(frozen=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    begin: int  # byte offsets into the data section
    end: int


def read_header(path: Path, where: str) -> dict[str, TensorEntry]:
    """The tensors ``path`` holds, every field checked; ConfigError naming ``where``, the
    file and the field otherwise."""
    at = f"{where}: {path.name}"
    size = path.stat().st_size
    if size < 8:
        raise ConfigError(f"{at} is {size} bytes, too short for a safetensors file: replace it")
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length == 0 or length > min(MAX_HEADER, size - 8):
            raise ConfigError(
                f"{at}: its header length {length} does not fit the file ({size} bytes; "
                f"at most {MAX_HEADER}): not a safetensors file, or a damaged one: replace it"
            )
        raw = f.read(length)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise ConfigError(f"{at}: its header is not JSON ({_short(error)}): replace it") from None
    if not isinstance(header, dict):
        raise ConfigError(f"{at}: its header is not a JSON object: replace it")
    _check_metadata(header.pop(METADATA, {}), at)
    tensors = {name: _entry(name, value, at) for name, value in header.items()}
    _check_offsets(tensors, size - 8 - length, at)
    return tensors


def _entry(name: str, value: object, at: str) -> TensorEntry:
    where = f"{at}: tensor {name}"
    if not isinstance(value, dict):
        raise ConfigError(f"{where} is described by {_short(value)}, not an object")
    dtype, shape, offsets = value.get("dtype"), value.get("shape"), value.get("data_offsets")
    if dtype not in WEIGHT_DTYPES:
        raise ConfigError(
            f"{where}: dtype {_short(dtype)}, but weights are read only as "
            f"{', '.join(WEIGHT_DTYPES)}: convert the file, or replace it"
        )
    if not (isinstance(shape, list) and all(_is_count(d) for d in shape)):
        raise ConfigError(f"{where}: shape {_short(shape)} is not a list of sizes >= 0")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets))):
        raise ConfigError(f"{where}: data_offsets {_short(offsets)} are not two offsets >= 0")
    begin, end = offsets
    need = math.prod(shape) * WEIGHT_DTYPES[dtype]
    if end - begin != need:
        raise ConfigError(
            f"{where}: data_offsets {offsets} hold {end - begin} bytes, but {dtype} of shape "
            f"{shape} needs {need}: the file is damaged: replace it"
        )
    return TensorEntry(dtype, tuple(shape), begin, end)


def _check_metadata(metadata: object, at: str) -> None:
    if not isinstance(metadata, dict):
        raise ConfigError(f"{at}: {METADATA} is {_short(metadata)}, not an object of strings")
    for key, value in metadata.items():
        if not isinstance(value, str):
            raise ConfigError(
                f"{at}: {METADATA} {key!r} is {_short(value)}; safetensors metadata values "
                "are strings: fix or replace the file"
            )


def _check_offsets(tensors: dict[str, TensorEntry], data_bytes: int, at: str) -> None:
    """Tensors lie inside the data section one after another, without overlaps or gaps
    (the format's rule, which safetensors enforces when the file is opened)."""
    end, previous = 0, "the start of the data"
    for name, entry in sorted(tensors.items(), key=lambda item: (item[1].begin, item[1].end)):
        if entry.end > data_bytes:
            raise ConfigError(
                f"{at}: tensor {name}: data_offsets end at byte {entry.end}, past the file's "
                f"{data_bytes} bytes of data (a truncated file?): replace it"
            )
        if entry.begin != end:
            how = "overlap those of" if entry.begin < end else "leave a gap after"
            raise ConfigError(
                f"{at}: tensor {name}: data_offsets [{entry.begin}, {entry.end}] {how} "
                f"{previous}: the file is damaged: replace it"
            )
        end, previous = entry.end, name


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
