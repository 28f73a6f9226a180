"""Megatron-LM indexed datasets written from the format's specification (Megatron-LM's
``megatron/core/datasets/indexed_dataset.py``), for tests: ``PREFIX.bin`` + ``PREFIX.idx``."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

CODES = {np.dtype("uint8"): 1, np.dtype("int16"): 3, np.dtype("int32"): 4, np.dtype("uint16"): 8}


def write_megatron(
    prefix: Path, documents: list[list[list[int]]], dtype=np.uint16, modes: bool = False
) -> Path:
    """Each document a list of sequences of token ids, as Megatron's builder lays them out:
    the sequences end to end in the .bin, their lengths and byte offsets in the .idx, and
    the document index (the first sequence of each document, then the sequence count);
    ``modes``: followed by one int8 sequence mode per sequence (the format's optional
    multimodal field)."""
    dtype = np.dtype(dtype)
    lengths, pointers, starts, offset = [], [], [0], 0
    with open(f"{prefix}.bin", "wb") as f:
        for document in documents:
            for sequence in document:
                f.write(np.asarray(sequence, dtype=dtype).tobytes())
                lengths.append(len(sequence))
                pointers.append(offset)
                offset += len(sequence) * dtype.itemsize
            starts.append(len(lengths))
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", CODES[dtype]))
        f.write(struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(starts)))
        f.write(np.asarray(lengths, dtype="<i4").tobytes())
        f.write(np.asarray(pointers, dtype="<i8").tobytes())
        f.write(np.asarray(starts, dtype="<i8").tobytes())
        if modes:
            f.write((np.arange(len(lengths)) % 2).astype("<i1").tobytes())
    return prefix
