"""The shard writer, and ``TokenShards`` to read a prepared data directory's token files
(the directory's format: ``data/manifest.py``)."""

import hashlib
from collections import OrderedDict
from pathlib import Path

import numpy as np

from yatrain.data.file_index import FileTable, open_manifest
from yatrain.data.manifest import TOKEN_DTYPES, TOKENIZER, load_manifest, split_entry
from yatrain.data.tokenizer import file_sha256
from yatrain.errors import DataError

_VERIFY_MAX_BYTES = 512 * 2**20  # above this, hashing every shard on open costs too much
MAX_OPEN_FILES = 64  # token files mapped at once: far below `ulimit -n` and vm.max_map_count


class ShardWriter:
    """Appends tokens to ``PREFIX-NNNNN.bin`` files of at most ``shard_tokens`` tokens each."""

    def __init__(self, directory: Path, dtype: str, shard_tokens: int, prefix: str = "tokens"):
        self.directory, self.dtype, self.shard_tokens = directory, TOKEN_DTYPES[dtype], shard_tokens
        self.prefix = prefix
        self.files: list[dict] = []
        self._digests: list = []

    def write(self, tokens: np.ndarray) -> None:
        tokens = tokens.astype(self.dtype, copy=False)
        while len(tokens):
            if not self.files or self.files[-1]["num_tokens"] == self.shard_tokens:
                name = f"{self.prefix}-{len(self.files):05d}.bin"
                self.files.append({"name": name, "num_tokens": 0})
                self._digests.append(hashlib.sha256())
            entry = self.files[-1]
            piece = tokens[: self.shard_tokens - entry["num_tokens"]]
            data = piece.tobytes()
            with open(self.directory / entry["name"], "ab") as f:
                f.write(data)
            self._digests[-1].update(data)
            entry["num_tokens"] += len(piece)
            tokens = tokens[len(piece) :]

    def close(self) -> list[dict]:
        for entry, digest in zip(self.files, self._digests, strict=True):
            entry["sha256"] = digest.hexdigest()
        return self.files


class TokenShards:
    """Read-only view of one split of a data directory as one long token stream: the
    training split, or the held-out ``validation`` split.

    Token files are memory-mapped when a read first needs them, at most ``MAX_OPEN_FILES``
    at a time (least recently used closed first), so any number of files works under the
    usual ``ulimit -n`` and ``vm.max_map_count``; a file's size is checked when it is mapped,
    so opening does not stat every file (300,000 files x 256 ranks on a parallel file system).
    What stays in memory is one int64 array of file ends and the file names."""

    def __init__(
        self, path: Path, manifest: dict, split: str = "train", files: FileTable | None = None
    ):
        self.path, self.split = path, split
        part = split_entry(manifest, split)
        self._dtype = TOKEN_DTYPES[manifest["dtype"]]
        self._files = files or FileTable.of(part["files"])  # ``files``: from the file index
        self._maps: OrderedDict[int, np.ndarray] = OrderedDict()
        self.vocab_size: int = manifest["vocab_size"]
        self.num_tokens: int = part["num_tokens"]
        self.tokenizer_sha256: str = manifest["tokenizer_sha256"]
        self.tokenizer_kind: str = manifest.get("tokenizer_kind", "sentencepiece")
        self.bos_id: int = manifest["bos_id"]
        self.eos_id: int = manifest["eos_id"]
        names = manifest.get("tokenizer_files", [TOKENIZER])
        self.tokenizer_files: list[Path] = [path / name for name in names]
        self.tokenizer_path: Path = self.tokenizer_files[0]  # the vocabulary file (hashed)

    @classmethod
    def open(
        cls, path: Path, verify_checksums: bool | None = None, split: str = "train"
    ) -> "TokenShards":
        """Open one split of a data directory. ``verify_checksums``: None (training's
        default) hashes and reads every file of data up to 512 MB and leaves larger data to
        be checked file by file as it is first read; True always hashes; False checks every
        file's size now without hashing (a one-time job that must see every file). A
        missing validation split is a DataError (``has_validation`` asks)."""
        path = Path(path)
        manifest, indexed = open_manifest(path)
        part = split_entry(manifest, split)
        if part is None:
            raise DataError(
                f"{path} has no held-out validation split: prepare it again with "
                "`yatrain prepare-data --val-fraction F`"
            )
        total_bytes = part["num_tokens"] * TOKEN_DTYPES[manifest["dtype"]].itemsize
        if verify_checksums is None:  # large data: each file checked when first read
            check_now, hash_files = total_bytes <= _VERIFY_MAX_BYTES, True
        else:
            check_now, hash_files = True, verify_checksums
        if check_now and indexed is not None:  # every file seen now: the manifest lists them
            manifest, indexed = load_manifest(path), None
            part = split_entry(manifest, split)
        fix = _rebuild(path)
        names = manifest.get("tokenizer_files", [TOKENIZER])
        for name in names:
            if not (path / name).is_file():
                raise DataError(f"{path / name} is missing: {fix}")
        if file_sha256(path / names[0]) != manifest["tokenizer_sha256"]:
            raise DataError(
                f"{path / names[0]} does not match the tokenizer_sha256 in the manifest: {fix}"
            )
        shards = cls(path, manifest, split, indexed.tables[split] if indexed else None)
        for index, entry in enumerate(part["files"] if check_now else []):
            array, file = shards._mapped(index), path / entry["name"]
            if not hash_files:
                continue
            if file_sha256(file) != entry["sha256"]:
                raise DataError(f"token file {file} fails its sha256 check (corrupted): {fix}")
            _check_ids(array, shards.vocab_size, f"token file {file}", fix)  # read anyway
        return shards

    def _mapped(self, index: int) -> np.ndarray:
        """Token file ``index`` as a memory map, mapped (and its size checked) on first use;
        the least recently used map is closed beyond ``MAX_OPEN_FILES``."""
        if index in self._maps:
            self._maps.move_to_end(index)
            return self._maps[index]
        file = self.path / self._files.name(index)
        count = self._files.end(index) - self._files.end(index - 1)
        expected = count * self._dtype.itemsize
        try:
            actual = file.stat().st_size
        except FileNotFoundError:
            raise DataError(f"token file {file} is missing: {_rebuild(self.path)}") from None
        if actual != expected:
            raise DataError(
                f"token file {file} has {actual} bytes, the manifest says {expected} "
                f"(truncated or overwritten?): {_rebuild(self.path)}"
            )
        self._maps[index] = np.memmap(file, dtype=self._dtype, mode="r")
        if len(self._maps) > MAX_OPEN_FILES:
            self._maps.popitem(last=False)  # its map closes when no read holds it
        return self._maps[index]

    def windows(self, seq_len: int) -> int:
        """How many windows of ``seq_len + 1`` tokens the stream holds (consecutive windows
        share one token: the last target of one is the first input of the next)."""
        return max(0, (self.num_tokens - 1) // seq_len)

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` of the whole stream as int64, across files;
        DataError for an id outside the manifest's vocabulary."""
        if start < 0 or length < 0 or start + length > self.num_tokens:
            raise IndexError(f"read({start}, {length}) outside [0, {self.num_tokens})")
        out = np.empty(length, dtype=np.int64)
        i = self._files.locate(start)
        done = 0
        while done < length:
            local = start + done - self._files.end(i - 1)
            array = self._mapped(i)
            take = min(length - done, len(array) - local)
            out[done : done + take] = array[local : local + take]
            done += take
            i += 1
        _check_ids(out, self.vocab_size, f"{self.path} at token {start:,}", _rebuild(self.path))
        return out

    def __repr__(self) -> str:
        return f"TokenShards({str(self.path)!r}, {self.split}, num_tokens={self.num_tokens:,})"


def _rebuild(path: Path) -> str:
    return f"re-run `yatrain prepare-data` into a new directory to rebuild {path}"


def _check_ids(tokens: np.ndarray, vocab_size: int, where: str, fix: str) -> None:
    """Every id below the manifest's vocabulary (else the embedding lookup would fail)."""
    if len(tokens) and int(tokens.max()) >= vocab_size:
        raise DataError(
            f"{where} holds token id {int(tokens.max())}, outside the vocabulary of "
            f"{vocab_size} its manifest declares (corrupted or mixed data): {fix}"
        )
