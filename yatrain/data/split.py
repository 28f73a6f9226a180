"""Which documents are held out for validation, decided by each document's content alone.

A document is held out when the first 8 bytes of the BLAKE2b hash of its UTF-8 text, read as
an unsigned big-endian integer, fall below ``val_fraction x 2**64``. Nothing but the text
decides, so the split is the same for any number of workers, any order of the input files
and any run, and a document that occurs twice in the corpus lands on the same side both
times (an exact duplicate never leaks from training into validation).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from yatrain.data.tokenizer import Tokenizer

DEFAULT_VAL_FRACTION = 0.005  # 0.5% of documents: millions of tokens from a billion-token corpus
_HASH_SPACE = 2**64


def held_out(text: str, val_fraction: float) -> bool:
    """Is this document in the validation split? (See the module docstring.)"""
    if val_fraction <= 0:
        return False
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") < val_fraction * _HASH_SPACE


@dataclass
class Packed:
    """One chunk of documents tokenized and packed, split into training and validation."""

    train: np.ndarray
    train_documents: int
    val: np.ndarray
    val_documents: int


def pack_split(
    tokenizer: Tokenizer, docs: list[str], dtype: np.dtype, threads: int, val_fraction: float
) -> Packed:
    """Each side's documents as ``[bos] ids [eos]`` back to back, in their original order."""
    sides = [held_out(doc, val_fraction) for doc in docs]
    train = [doc for doc, side in zip(docs, sides, strict=True) if not side]
    val = [doc for doc, side in zip(docs, sides, strict=True) if side]

    def packed(texts: list[str]) -> np.ndarray:
        return tokenizer.encode_packed(texts, dtype, threads) if texts else np.empty(0, dtype)

    return Packed(packed(train), len(train), packed(val), len(val))
