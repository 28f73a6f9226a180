"""The tokenized data set on disk: its format, the shard writer, and ``TokenShards`` to read it.

A data directory holds::

    tokenizer.model       the tokenizer the tokens were produced with (sentencepiece or
                          tiktoken), or tokenizer.json + tokenizer_config.json (Hugging Face)
    tokens-00000.bin ...  raw little-endian uint16 (vocab <= 65536) or uint32 token ids
    val-00000.bin ...     the validation split (held-out documents), in the same format
    manifest.json         format, dtype, tokenizer kind/hash/BOS/EOS/vocabulary, counts,
                          skipped inputs, per-file sizes/sha256, and the validation split's
                          counts and files (``validation``: null when none was held out)

Every document is stored as ``[bos] + tokens + [eos]``, packed back to back with no padding;
the files of a split are simply consecutive pieces of that one stream. The top-level counts
and ``files`` are the training split. The directory is built under a temporary name and
renamed into place at the end, so a directory with a manifest is complete. A data set
prepared in parts (``prepare-data --shard I/N``, then ``--merge``) keeps each part's files
under ``parts/``; its manifest names them by their path below the directory.
"""

import hashlib
import json
import re
from collections import OrderedDict
from pathlib import Path

import numpy as np

from yatrain.data.tokenizer import file_sha256
from yatrain.errors import DataError

FORMAT = "yatrain-tokens-v1"
MANIFEST = "manifest.json"
TOKENIZER = "tokenizer.model"  # the tokenizer file of data prepared before tokenizer kinds
TOKENIZER_KINDS = ("sentencepiece", "tiktoken", "hf")
SPLITS = ("train", "validation")
_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
_VERIFY_MAX_BYTES = 512 * 2**20  # above this, hashing every shard on open costs too much
MAX_OPEN_FILES = 64  # token files mapped at once: far below `ulimit -n` and vm.max_map_count


def token_dtype(vocab_size: int) -> str:
    """The narrowest dtype name that holds every id of a ``vocab_size`` vocabulary."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


class ShardWriter:
    """Appends tokens to ``PREFIX-NNNNN.bin`` files of at most ``shard_tokens`` tokens each."""

    def __init__(self, directory: Path, dtype: str, shard_tokens: int, prefix: str = "tokens"):
        self.directory, self.dtype, self.shard_tokens = directory, _DTYPES[dtype], shard_tokens
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


def split_entry(manifest: dict, split: str) -> dict | None:
    """A split's ``num_documents``, ``num_tokens`` and ``files``; None when it has none."""
    if split == "train":
        return manifest
    return manifest.get("validation")


class TokenShards:
    """Read-only view of one split of a data directory as one long token stream: the
    training split, or the held-out ``validation`` split.

    Token files are memory-mapped when a read first needs them, at most ``MAX_OPEN_FILES``
    at a time (least recently used closed first), so any number of files works under the
    usual ``ulimit -n`` and ``vm.max_map_count``; a file's size is checked when it is mapped,
    so opening does not stat every file (300,000 files x 256 ranks on a parallel file system).
    What stays in memory is one int64 array of file ends and the file names."""

    def __init__(self, path: Path, manifest: dict, split: str = "train"):
        self.path, self.split = path, split
        part = split_entry(manifest, split)
        self._dtype = _DTYPES[manifest["dtype"]]
        self._names = [entry["name"] for entry in part["files"]]
        sizes = [entry["num_tokens"] for entry in part["files"]]
        self._ends = np.cumsum(np.asarray(sizes, dtype=np.int64))
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
        manifest = load_manifest(path)
        part = split_entry(manifest, split)
        if part is None:
            raise DataError(
                f"{path} has no held-out validation split: prepare it again with "
                "`yatrain prepare-data --val-fraction F`"
            )
        total_bytes = part["num_tokens"] * _DTYPES[manifest["dtype"]].itemsize
        if verify_checksums is None:  # large data: each file checked when first read
            check_now, hash_files = total_bytes <= _VERIFY_MAX_BYTES, True
        else:
            check_now, hash_files = True, verify_checksums
        fix = _rebuild(path)
        names = manifest.get("tokenizer_files", [TOKENIZER])
        for name in names:
            if not (path / name).is_file():
                raise DataError(f"{path / name} is missing: {fix}")
        if file_sha256(path / names[0]) != manifest["tokenizer_sha256"]:
            raise DataError(
                f"{path / names[0]} does not match the tokenizer_sha256 in the manifest: {fix}"
            )
        shards = cls(path, manifest, split)
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
        file = self.path / self._names[index]
        count = int(self._ends[index] - (self._ends[index - 1] if index else 0))
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
        i = int(np.searchsorted(self._ends, start, side="right"))
        done = 0
        while done < length:
            local = start + done - (int(self._ends[i - 1]) if i else 0)
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


def load_manifest(path: Path, part: bool = False) -> dict:
    """The checked manifest of the data directory ``path``; one part of a data set prepared
    in parts (``prepare-data --shard``) is not a data set to use (only the merge, ``part``,
    reads one)."""
    path = Path(path)
    if not (path / MANIFEST).is_file():
        raise DataError(_no_data(path))
    manifest = _load_manifest(path / MANIFEST)
    record = manifest.get("part")
    if isinstance(record, dict) and not part:
        root = path.parent.parent if path.parent.name == "parts" else path.parent
        raise DataError(
            f"{path} is part {record.get('index')}/{record.get('count')} of a data set "
            f"prepared in parts (prepare-data --shard), not the whole: run `yatrain "
            f"prepare-data --merge {root}` once every part is done and use {root}"
        )
    return manifest


def _no_data(path: Path) -> str:
    """What to run when ``path`` is not a tokenized data directory: parts not merged yet
    are merged; raw documents are tokenized into a new directory next to them
    (prepare-data never writes into one)."""
    if (path / "parts").is_dir() and any((path / "parts").glob("part-*-of-*")):
        return (
            f"{path} holds parts of a data set (prepare-data --shard) but was not merged: "
            f"run `yatrain prepare-data --merge {path}` once every part is done"
        )
    if path.is_file() or (path.is_dir() and any(path.iterdir())):
        named = path.resolve() if path.name in ("", "..") else path
        stem = named.stem if path.is_file() else named.name
        if not stem:  # the root directory: no directory beside it to suggest
            return (
                f"{path} is not tokenized data (it has no {MANIFEST}): pass a directory "
                "that `yatrain prepare-data` wrote"
            )
        out = named.with_name(f"{stem}-tokenized")
        return (
            f"{path} is not tokenized data (it has no {MANIFEST}): tokenize it with `yatrain "
            f"prepare-data --input {path} --output {out} --tokenizer TOKENIZER` (the training "
            f"data's tokenizer) and use {out}"
        )
    command = f"yatrain prepare-data --output {path} --vocab-size 4096 --val-fraction 0.02"
    return f"no tokenized data at {path}: run `{command}` (the built-in corpus) first"


def has_validation(manifest: dict) -> bool:
    """Was a validation split written (prepared with a positive ``--val-fraction`` that held
    out at least one document)?"""
    return manifest.get("validation") is not None


def _check_ids(tokens: np.ndarray, vocab_size: int, where: str, fix: str) -> None:
    """Every id below the manifest's vocabulary (else the embedding lookup would fail)."""
    if len(tokens) and int(tokens.max()) >= vocab_size:
        raise DataError(
            f"{where} holds token id {int(tokens.max())}, outside the vocabulary of "
            f"{vocab_size} its manifest declares (corrupted or mixed data): {fix}"
        )


def _load_manifest(file: Path) -> dict:
    """Parse and sanity-check a manifest so later code can trust its fields."""
    fix = "re-run `yatrain prepare-data` into a new directory"
    try:
        manifest = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{file} is not valid JSON ({e}): {fix}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise DataError(f"{file} has format {found!r}, expected {FORMAT!r}: {fix}")
    fields = {
        "dtype": str,
        "tokenizer_sha256": str,
        "vocab_size": int,
        "bos_id": int,
        "eos_id": int,
        "num_documents": int,
        "num_tokens": int,
        "files": list,
    }
    for key, kind in fields.items():
        if not isinstance(manifest.get(key), kind):
            raise DataError(f"{file} lacks a valid {key!r} field: {fix}")
    names = manifest.get("tokenizer_files", [TOKENIZER])  # absent before tokenizer kinds
    valid = isinstance(names, list) and names and all(isinstance(n, str) for n in names)
    if not valid or any("/" in n or n.startswith(".") for n in names):
        raise DataError(f"{file} has an invalid 'tokenizer_files' field {names!r}: {fix}")
    if manifest.get("tokenizer_kind", "sentencepiece") not in TOKENIZER_KINDS:
        raise DataError(f"{file} has an unknown tokenizer_kind: {fix}")
    if manifest["dtype"] not in _DTYPES or manifest["dtype"] != token_dtype(manifest["vocab_size"]):
        raise DataError(
            f"{file} has dtype {manifest['dtype']!r} for vocab size {manifest['vocab_size']}: {fix}"
        )
    validation = manifest.get("validation")
    if validation is not None:
        ok = isinstance(validation, dict) and isinstance(validation.get("files"), list)
        ok = ok and all(isinstance(validation.get(k), int) for k in ("num_tokens", "num_documents"))
        if not ok:
            raise DataError(f"{file} has an invalid 'validation' entry: {fix}")
    for part in [manifest] if validation is None else [manifest, validation]:
        _check_files(file, part, fix)
    return manifest


# A token file's name is a relative path below the data directory (a merged data set names
# its parts' files ``parts/PART/tokens-NNNNN.bin``): no piece empty or starting with a dot,
# so never ``..``, hidden or absolute. One regular expression: 300,000 names in milliseconds.
_INSIDE = re.compile(r"(?:[^/.][^/]*/)*[^/.][^/]*")


def _valid_entry(entry: object) -> bool:
    if type(entry) is not dict:
        return False
    name, count = entry.get("name"), entry.get("num_tokens")
    return (
        type(name) is str
        and type(count) is int  # not a bool
        and count > 0
        and type(entry.get("sha256")) is str
        and _INSIDE.fullmatch(name) is not None
    )


def _check_files(file: Path, part: dict, fix: str) -> None:
    bad = next((entry for entry in part["files"] if not _valid_entry(entry)), None)
    if bad is not None:
        raise DataError(f"{file} has an invalid files entry {bad!r}: {fix}")
    if sum(e["num_tokens"] for e in part["files"]) != part["num_tokens"]:
        raise DataError(f"{file}: num_tokens differs from the sum over its files: {fix}")
