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
merge lays them out), so no read can fall outside it (the checks:
``yatrain.data.megatron_index``).

The format records no tokenizer and no BOS: ``data.tokenizer`` names the tokenizer, whose
vocabulary bounds the ids. Each document (its sequences, from the document index; empty
ones skipped) is read the way yatrain stores its own: ``[bos] tokens [eos]``, the BOS left
out when the document already starts with it and the EOS when it already ends with it
(Megatron's ``--append-eod``). So document masking and restarted positions
(``data.document_mask``, ``data.restart_positions``) find the ``.idx``'s document
boundaries in the tokens, exactly as for prepared data.

Memory does not grow with the document count (a corpus may hold billions): opening streams
over the index and one token at each end of every document with file reads, a bounded chunk
at a time, checking as it goes, and keeps only a sparse index in RAM, the stream position of
every ``_GROUP``-th document (8 bytes per group). Both files are memory-mapped; a read lays
out the groups it touches (each document's place in the ``.bin`` and whether it gets a BOS
and an EOS) from the maps, and keeps the last few groups laid out.
"""

from __future__ import annotations

import atexit
import difflib
import functools
import io
import shutil
import tempfile
from pathlib import Path, PosixPath

import numpy as np

from yatrain.data.megatron_index import (
    HEADER,
    FileArray,
    check_document_index,
    check_sequences,
    read_header,
)
from yatrain.data.shards import TokenShards
from yatrain.data.tokenizer import Tokenizer
from yatrain.data.tokenizer_formats import load_tokenizer
from yatrain.errors import ConfigError, DataError

# The reader's settings; the .idx checks (yatrain.data.megatron_index) take the first two
# as arguments, so that tests shrink them here.
_CHUNK = 1 << 16  # index entries (or tokens) read and checked at a time when opening
_WINDOW = 1 << 20  # bytes of a file read at once to pick scattered entries out of it
_GROUP = 4096  # documents per entry of the sparse index kept in memory
_CACHED_GROUPS = 16  # groups whose layout read() keeps (consecutive windows share them)
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


def misspelt_prefix(path: str | Path, key: str = "") -> DataError | None:
    """When ``path`` is nothing at all but Megatron prefixes lie beside it (a mistyped
    prefix), the error naming them (else None: a data directory's own checks speak)."""
    text = str(path)
    stem = Path(text[:-4] if text.endswith((".bin", ".idx")) else text)
    if not stem.name or Path(text).exists() or megatron_prefix(path) is not None:
        return None
    try:
        found = {p.with_suffix("") for p in stem.parent.glob("*.idx")} | {
            p.with_suffix("") for p in stem.parent.glob("*.bin")
        }
    except OSError:
        return None
    if not found:
        return None
    names = [p.name for p in sorted(found)]
    near = difflib.get_close_matches(stem.name, names, n=3, cutoff=0.5) or names[:3]
    listed = " or ".join(str(stem.parent / name) for name in near)
    return DataError(
        f"{key + ' ' if key else ''}{path}: there is no data directory there, nor a Megatron "
        f"dataset {stem}.bin/.idx; Megatron prefixes beside it: {listed}: point at one of them"
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
        bin_bytes = binary.stat().st_size
        self.dtype, self._sequences, entries = read_header(prefix, idx)
        self._bin_tokens, self._documents = bin_bytes // self.dtype.itemsize, entries - 1
        self.vocab_size, self.bos_id, self.eos_id = (
            tokenizer.vocab_size,
            tokenizer.bos_id,
            tokenizer.eos_id,
        )
        self.tokenizer_sha256, self.tokenizer_kind = tokenizer.sha256, tokenizer.kind
        self.tokenizer_files = _saved(tokenizer)
        self.tokenizer_path = self.tokenizer_files[0]
        with open(idx, "rb") as index, open(binary, "rb") as data:
            lengths = FileArray(index, "<i4", HEADER.size, _WINDOW)
            pointers = FileArray(index, "<i8", HEADER.size + 4 * self._sequences, _WINDOW)
            check_sequences(
                prefix, lengths, pointers, self._sequences, self.dtype.itemsize, bin_bytes, _CHUNK
            )
            documents = FileArray(index, "<i8", HEADER.size + 12 * self._sequences, _WINDOW)
            tokens = FileArray(data, self.dtype, 0, _WINDOW)
            self._group_starts, self.num_documents = self._index_groups(
                prefix, documents, pointers, tokens
            )
            if self.num_documents and bin_bytes <= _VERIFY_MAX_BYTES:
                for lo in range(0, self._bin_tokens, _CHUNK):
                    self._check(tokens.slice(lo, min(lo + _CHUNK, self._bin_tokens)), lo)
        self.num_tokens = int(self._group_starts[-1])
        raw = np.memmap(idx, dtype=np.uint8, mode="r")
        self._pointers = np.frombuffer(raw, "<i8", self._sequences, pointers.offset)
        self._entries = np.frombuffer(raw, "<i8", entries, documents.offset)
        mapped = np.memmap(binary, dtype=self.dtype, mode="r") if bin_bytes else None
        self._tokens = None if mapped is None else np.asarray(mapped)  # faster to index
        self._group = functools.lru_cache(maxsize=_CACHED_GROUPS)(self._group_layout)

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
        end, starts = start + length, self._group_starts
        out = np.empty(length, dtype=np.int64)
        token = np.zeros(length, dtype=bool)  # read from the .bin (else an added BOS/EOS)
        places = []
        first, last = np.searchsorted(starts, [start, end - 1], side="right") - 1
        for group in range(int(first), int(last) + 1):
            lo, hi = max(start, int(starts[group])), min(end, int(starts[group + 1]))
            if lo == hi:  # only empty documents
                continue
            doc_start, doc_length, front, vstart = self._group(group)
            place = np.arange(lo, hi, dtype=np.int64)
            doc = np.searchsorted(vstart, place, side="right") - 1
            inner = place - vstart[doc] - front[doc]  # -1: its BOS
            here = (inner >= 0) & (inner < doc_length[doc])
            out[lo - start : hi - start] = np.where(inner < 0, self.bos_id, self.eos_id)
            token[lo - start : hi - start] = here
            places.append((doc_start[doc] + inner)[here])
        real = np.concatenate(places)  # increasing: one slice of the .bin holds them
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

    def _index_groups(
        self, prefix: Path, documents: FileArray, pointers: FileArray, tokens: FileArray
    ) -> tuple[np.ndarray, int]:
        """The stream position of each group's first document, then the stream's end, and
        the count of documents that hold tokens, with the document index checked to run
        monotonically from 0 to S on the way (whole groups at a time: bounded memory)."""
        starts, done, documents_with_tokens = [], 0, 0
        chunk = _GROUP * max(1, _CHUNK // _GROUP)
        for lo in range(0, max(self._documents, 1), chunk):
            hi = min(lo + chunk, self._documents)
            entries = documents.slice(lo, hi + 1)
            check_document_index(prefix, entries, lo == 0, hi == self._documents, self._sequences)
            _, length, front, back = self._layout(entries, pointers, tokens)
            documents_with_tokens += int(np.count_nonzero(length))
            place = done + np.concatenate([[0], np.cumsum(front + length + back)])
            starts.append(place[:-1:_GROUP].copy())  # a view would keep all of place
            done = int(place[-1])
        return np.concatenate([*starts, [done]]).astype(np.int64), documents_with_tokens

    def _group_layout(self, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The documents of group ``group``: their first token in the .bin, their lengths,
        1 where a BOS is added, and their positions in the stream (one more: the end)."""
        lo = group * _GROUP
        entries = self._entries[lo : min(lo + _GROUP, self._documents) + 1]
        start, length, front, back = self._layout(entries, self._pointers, self._tokens)
        place = self._group_starts[group] + np.concatenate([[0], np.cumsum(front + length + back)])
        return start, length, front, place

    def _layout(self, entries: np.ndarray, pointers, tokens) -> tuple[np.ndarray, ...]:
        """The documents between consecutive document index ``entries``: their first token
        in the .bin, their lengths, and 1 where a BOS / an EOS is added (0 where the document
        has it already, and for an empty one). ``pointers`` and ``tokens`` give the .idx's
        pointers and the .bin's tokens at ascending places (maps, or files read by windows)."""
        bounds = np.full(len(entries), self._bin_tokens, dtype=np.int64)
        inside = entries < self._sequences
        bounds[inside] = pointers[entries[inside]] // self.dtype.itemsize
        start, length = bounds[:-1], np.diff(bounds)
        front, back = np.zeros_like(length), np.zeros_like(length)
        full = np.flatnonzero(length)
        if len(full):
            ends = np.column_stack([start[full], start[full] + length[full] - 1])
            first, last = tokens[ends.ravel()].reshape(-1, 2).T
            front[full], back[full] = first != self.bos_id, last != self.eos_id
        return start, length, front, back

    def __repr__(self) -> str:
        return f"MegatronTokens({str(self.path)!r}, num_tokens={self.num_tokens:,})"


class _KeptFile(PosixPath):
    """A tokenizer file saved for checkpoints, its bytes also kept in memory: read after its
    temporary copy was deleted (the temporary directory cleaned mid-run, as the docs allow
    for the private cache's ``tmp``), it is read from memory, so every checkpoint still
    gets its tokenizer."""

    kept: bytes | None = None  # paths derived from this one (its parent, ...) keep nothing

    def open(self, mode="r", *args, **kwargs):  # type: ignore[override]
        try:
            return super().open(mode, *args, **kwargs)
        except FileNotFoundError:
            if self.kept is None or mode != "rb":
                raise
            return io.BytesIO(self.kept)


_SAVED: dict[str, list[Path]] = {}


def _saved(tokenizer: Tokenizer) -> list[Path]:
    """The tokenizer's files as a data directory holds them (what checkpoints copy), saved
    once per process in a temporary folder removed at exit, and kept in memory too."""
    if tokenizer.sha256 not in _SAVED:
        folder = Path(tempfile.mkdtemp(prefix="yatrain-tokenizer-"))
        atexit.register(shutil.rmtree, folder, True)
        files = []
        for name in tokenizer.save(folder):
            file = _KeptFile(folder / name)
            file.kept = file.read_bytes()
            files.append(file)
        _SAVED[tokenizer.sha256] = files
    return _SAVED[tokenizer.sha256]


def open_stream(
    path: str | Path, tokenizer: str | Path | None, key: str = "data.path"
) -> TokenShards | MegatronTokens:
    """The training stream at ``path``: a Megatron prefix, else a prepared directory."""
    if megatron_prefix(path) is not None:
        return MegatronTokens.open(path, tokenizer, key)
    if (misspelt := misspelt_prefix(path, key)) is not None:
        raise misspelt
    return TokenShards.open(Path(path))
