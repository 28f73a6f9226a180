"""One ``Tokenizer`` interface over three file formats, told apart by their content.

- sentencepiece ``.model`` (Llama 2, or one trained by ``prepare-data --vocab-size``): a
  protobuf file;
- tiktoken BPE ranks (Llama 3's ``tokenizer.model``): text, one ``base64 rank`` per line;
- Hugging Face ``tokenizer.json`` (or a model directory holding one): a JSON document.

Every kind encodes ordinary text only: text that looks like a special token (``<s>``,
``<|eot_id|>``) is encoded as the characters it is, never as that token. BOS and EOS are
the ids the data pipeline wraps each document in; a tokenizer without them is refused.
"""

from __future__ import annotations

import hashlib
import shutil
from abc import ABC, abstractmethod
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file, read in chunks so large shards do not need to fit in memory."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


class Tokenizer(ABC):
    """What the data pipeline needs from a tokenizer, whatever its file format."""

    kind: str  # "sentencepiece", "tiktoken" or "hf"
    path: Path  # the file the vocabulary was read from
    vocab_size: int  # one more than the largest id it can produce (specials included)
    bos_id: int
    eos_id: int
    sha256: str  # of ``path``: identifies the tokenizer in manifests and checkpoints

    stored_name = "tokenizer.model"  # its name inside data directories and checkpoints

    def save(self, folder: Path) -> list[str]:
        """Write the files that reproduce this tokenizer into ``folder``; their names."""
        shutil.copyfile(self.path, Path(folder) / self.stored_name)
        return [self.stored_name]

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of one text, without BOS/EOS, special-looking text kept as text."""

    def encode_batch(self, texts: list[str], threads: int = 1) -> list[list[int]]:
        """Token ids of many texts on ``threads`` threads (the data pipeline uses one per
        worker process and gets its parallelism from the processes)."""
        if threads <= 1:
            return [self.encode(text) for text in texts]
        with ThreadPoolExecutor(threads) as pool:  # the encoders release the GIL
            return list(pool.map(self.encode, texts))

    def encode_packed(self, texts: list[str], dtype: np.dtype, threads: int = 1) -> np.ndarray:
        """Each text's ids between BOS and EOS, back to back, as stored in data shards."""
        flat: list[int] = []
        for ids in self.encode_batch(texts, threads=threads):
            flat.append(self.bos_id)
            flat.extend(ids)
            flat.append(self.eos_id)
        return np.array(flat, dtype=dtype)

    @abstractmethod
    def decode(self, ids: Iterable[int]) -> str:
        """Text of a token id sequence; BOS/EOS decode to nothing."""

    @abstractmethod
    def token_id(self, token: str) -> int | None:
        """The id of a token string (special tokens included), or None if it has none."""

    def describe(self) -> dict:
        """The facts a manifest records about the tokenizer."""
        return {
            "tokenizer_kind": self.kind,
            "tokenizer_sha256": self.sha256,
            "vocab_size": self.vocab_size,
            "bos_id": self.bos_id,
            "eos_id": self.eos_id,
        }

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({str(self.path)!r}, vocab_size={self.vocab_size}, "
            f"bos={self.bos_id}, eos={self.eos_id})"
        )
