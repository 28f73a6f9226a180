"""Megatron-LM indexed datasets (``PREFIX.bin`` + ``PREFIX.idx``) read as a token stream.

The format, as Megatron-LM's ``megatron/core/datasets/indexed_dataset.py`` writes and reads
it (all little-endian): the ``.idx`` holds the 9 bytes ``MMIDIDX\\0\\0``, a u64 version (1),
a u8 dtype code (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8
uint16), a u64 sequence count S and a u64 document-index count D, then S int32 sequence
lengths (in tokens), S int64 sequence pointers (byte offsets into the ``.bin``) and D int64
document indices (the sequence each document starts at, from 0 to S: D - 1 documents),
optionally followed by S int8 sequence modes (multimodal data). The ``.bin`` holds the
tokens. Every header field is checked against the two files' lengths before anything is
mapped, and the sequences must tile the ``.bin`` in order (as every Megatron writer and
merge lays them out), so no read can fall outside it.

The format records no tokenizer and no BOS: ``data.tokenizer`` names the tokenizer, whose
vocabulary bounds the ids. Each document (its sequences, from the document index; empty
ones skipped) is read the way yatrain stores its own: ``[bos] tokens [eos]``, the BOS left
out when the document already starts with it and the EOS when it already ends with it
(Megatron's ``--append-eod``). So document masking and restarted positions
(``data.document_mask``, ``data.restart_positions``) find the ``.idx``'s document
boundaries in the tokens, exactly as for prepared data. The ``.bin`` is memory-mapped;
opening reads the index and one token at each end of every document.
"""

from __future__ import annotations

import atexit
import shutil
import struct
import tempfile
from pathlib import Path

import numpy as np

from yatrain.data.shards import TokenShards
from yatrain.data.tokenizer import Tokenizer
from yatrain.data.tokenizer_formats import load_tokenizer
from yatrain.errors import ConfigError, DataError

MAGIC = b"MMIDIDX\x00\x00"
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequences, document indices
DTYPES = {1: "u1", 2: "i1", 3: "<i2", 4: "<i4", 5: "<i8", 8: "<u2"}  # token ids: integers
_FLOATS = {6: "float64", 7: "float32"}
_CHUNK = 1 << 24  # index entries checked at a time (bounded memory)
_VERIFY_MAX_BYTES = 512 * 2**20


def megatron_prefix(path: str | Path) -> Path | None:
    """The prefix when ``path`` names a Megatron dataset (``PREFIX``, ``PREFIX.bin`` or
    ``PREFIX.idx`` with either file present), else None."""
    text = str(path)
    if text.endswith((".bin", ".idx")):
        text = text[:-4]
    prefix = Path(text)
    if Path(text + ".idx").is_file() or Path(text + ".bin").is_file():
        return prefix
    return None


def _fail(prefix: Path, problem: str) -> DataError:
    return DataError(
        f"Megatron index {prefix}.idx {problem}: it is not a valid Megatron-LM indexed "
        "dataset for its .bin; rebuild the pair (preprocess_data.py) or point at another prefix"
    )


class MegatronTokens:
    """A Megatron ``.bin``/``.idx`` pair as one long stream of ``[bos] doc [eos]`` (see the
    module docstring), with what the loaders need of a data set (``TokenShards``'s reading
    interface)."""

    split = "train"

    def __init__(self, prefix: Path, tokenizer: Tokenizer):
        self.path = prefix
        idx, binary = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
        for file in (idx, binary):
            if not file.is_file():
                raise DataError(f"{file} is missing: a Megatron dataset needs both .bin and .idx")
        self.dtype, lengths, starts = _read_index(prefix, idx, binary.stat().st_size)
        self._tokens = np.memmap(binary, dtype=self.dtype, mode="r") if starts[-1] else None
        self.vocab_size, self.bos_id, self.eos_id = (
            tokenizer.vocab_size,
            tokenizer.bos_id,
            tokenizer.eos_id,
        )
        self.tokenizer_sha256, self.tokenizer_kind = tokenizer.sha256, tokenizer.kind
        self.tokenizer_files = _saved(tokenizer)
        self.tokenizer_path = self.tokenizer_files[0]
        keep = lengths > 0
        self._start, self._length = starts[:-1][keep], lengths[keep]
        self.num_documents = len(self._length)
        if self.num_documents and binary.stat().st_size <= _VERIFY_MAX_BYTES:
            self._check(np.asarray(self._tokens), 0)
        if self.num_documents:
            first = np.asarray(self._tokens[self._start])
            last = np.asarray(self._tokens[self._start + self._length - 1])
            self._front = (first != self.bos_id).astype(np.int64)
            back = (last != self.eos_id).astype(np.int64)
        else:
            self._front = back = np.zeros(0, dtype=np.int64)
        sizes = self._front + self._length + back
        self._vstart = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.num_tokens = int(self._vstart[-1])

    @classmethod
    def open(cls, path: str | Path, tokenizer: str | Path | None, key: str = "data.path"):
        """The Megatron dataset at ``path``, read with the tokenizer ``tokenizer``."""
        prefix = megatron_prefix(path) or Path(path)
        if tokenizer is None:
            raise ConfigError(
                f"{key} {path} is a Megatron-LM indexed dataset, which does not record its "
                "tokenizer: set data.tokenizer to the tokenizer it was made with"
            )
        return cls(prefix, load_tokenizer(Path(tokenizer)))

    def windows(self, seq_len: int) -> int:
        """Windows of ``seq_len + 1`` tokens in the stream (as ``TokenShards.windows``)."""
        return max(0, (self.num_tokens - 1) // seq_len)

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` of the stream as int64."""
        if start < 0 or length < 0 or start + length > self.num_tokens:
            raise IndexError(f"read({start}, {length}) outside [0, {self.num_tokens})")
        if length == 0:
            return np.empty(0, dtype=np.int64)
        place = np.arange(start, start + length, dtype=np.int64)
        doc = np.searchsorted(self._vstart, place, side="right") - 1
        inner = place - self._vstart[doc] - self._front[doc]  # -1: its BOS
        token = (inner >= 0) & (inner < self._length[doc])
        out = np.where(inner < 0, self.bos_id, self.eos_id).astype(np.int64)
        real = (self._start[doc] + inner)[token]  # increasing: one slice of the .bin holds them
        if len(real):
            lo, hi = int(real[0]), int(real[-1]) + 1
            block = np.asarray(self._tokens[lo:hi], dtype=np.int64)
            self._check(block, lo)
            out[token] = block[real - lo]
        return out

    def _check(self, tokens: np.ndarray, offset: int) -> None:
        """Every id within the tokenizer's vocabulary (and not negative)."""
        if len(tokens) and (int(tokens.min()) < 0 or int(tokens.max()) >= self.vocab_size):
            bad = int(tokens.max()) if int(tokens.max()) >= self.vocab_size else int(tokens.min())
            raise DataError(
                f"{self.path}.bin holds token id {bad} (near token {offset:,}), outside the "
                f"vocabulary of {self.vocab_size} of data.tokenizer: set data.tokenizer to the "
                "tokenizer this data was made with"
            )

    def __repr__(self) -> str:
        return f"MegatronTokens({str(self.path)!r}, num_tokens={self.num_tokens:,})"


def _read_index(prefix: Path, idx: Path, bin_bytes: int) -> tuple[np.dtype, np.ndarray, np.ndarray]:
    """The token dtype, and each document's length and first token in the ``.bin``
    (starts has one more entry: the end), after checking the index against the files."""
    size = idx.stat().st_size
    if size < HEADER.size:
        raise _fail(prefix, f"has {size} bytes, fewer than its {HEADER.size}-byte header")
    with open(idx, "rb") as f:
        magic, version, code, sequences, entries = HEADER.unpack(f.read(HEADER.size))
    if magic != MAGIC:
        raise _fail(prefix, f"starts with {magic!r}, not {MAGIC!r}")
    if version != 1:
        raise _fail(prefix, f"has version {version}; version 1 is the one read")
    if code not in DTYPES:
        kind = f"{_FLOATS[code]}, not token ids" if code in _FLOATS else "unknown"
        raise _fail(prefix, f"has dtype code {code} ({kind})")
    dtype = np.dtype(DTYPES[code])
    body = sequences * 12 + entries * 8
    if entries < 1 or size not in (HEADER.size + body, HEADER.size + body + sequences):
        raise _fail(
            prefix,
            f"has {size} bytes, but its header ({sequences:,} sequences, {entries:,} document "
            f"index entries) needs {HEADER.size + body} (or {sequences:,} more with modes)",
        )
    raw = np.memmap(idx, dtype=np.uint8, mode="r")
    offset = HEADER.size
    lengths = np.frombuffer(raw, dtype="<i4", count=sequences, offset=offset)
    pointers = np.frombuffer(raw, dtype="<i8", count=sequences, offset=offset + 4 * sequences)
    documents = np.frombuffer(raw, dtype="<i8", count=entries, offset=offset + 12 * sequences)
    token_start = _check_sequences(prefix, lengths, pointers, dtype.itemsize, bin_bytes)
    if documents[0] != 0 or documents[-1] != sequences or np.any(np.diff(documents) < 0):
        raise _fail(prefix, f"has a document index that does not run from 0 up to {sequences}")
    starts = token_start[documents]
    return dtype, np.diff(starts), starts


def _check_sequences(
    prefix: Path, lengths: np.ndarray, pointers: np.ndarray, itemsize: int, bin_bytes: int
) -> np.ndarray:
    """The token offset of every sequence and of the end, once the lengths are non-negative
    and the pointers lay the sequences end to end over the whole ``.bin``."""
    starts = np.zeros(len(lengths) + 1, dtype=np.int64)
    done = 0
    for lo in range(0, len(lengths), _CHUNK):
        part = lengths[lo : lo + _CHUNK].astype(np.int64)
        if len(part) and int(part.min()) < 0:
            raise _fail(prefix, f"has a negative sequence length ({int(part.min())})")
        ends = done + np.cumsum(part)
        starts[lo + 1 : lo + 1 + len(part)] = ends
        expected = starts[lo : lo + len(part)] * itemsize
        wrong = np.flatnonzero(pointers[lo : lo + _CHUNK] != expected)
        if len(wrong):
            k = lo + int(wrong[0])
            raise _fail(
                prefix,
                f"points sequence {k} at byte {int(pointers[k])}, not {int(expected[wrong[0]])} "
                "(sequences must follow each other in the .bin)",
            )
        done = int(ends[-1]) if len(part) else done
    if done * itemsize != bin_bytes:
        raise _fail(
            prefix,
            f"describes {done * itemsize:,} bytes of tokens, but the .bin has {bin_bytes:,}",
        )
    return starts


_SAVED: dict[str, list[Path]] = {}


def _saved(tokenizer: Tokenizer) -> list[Path]:
    """The tokenizer's files as a data directory holds them (what checkpoints copy), saved
    once per process in a temporary folder removed at exit."""
    if tokenizer.sha256 not in _SAVED:
        folder = Path(tempfile.mkdtemp(prefix="yatrain-tokenizer-"))
        atexit.register(shutil.rmtree, folder, True)
        _SAVED[tokenizer.sha256] = [folder / name for name in tokenizer.save(folder)]
    return _SAVED[tokenizer.sha256]


def open_stream(
    path: str | Path, tokenizer: str | Path | None, key: str = "data.path"
) -> TokenShards | MegatronTokens:
    """The training stream at ``path``: a Megatron prefix, else a prepared directory."""
    if megatron_prefix(path) is not None:
        return MegatronTokens.open(path, tokenizer, key)
    return TokenShards.open(Path(path))
