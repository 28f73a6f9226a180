"""The tokenized data set on disk: writing it (``prepare_data``) and reading it (``TokenShards``).

A data directory holds::

    tokenizer.model       the sentencepiece model the tokens were produced with
    tokens-00000.bin ...  raw little-endian uint16 (vocab <= 65536) or uint32 token ids
    manifest.json         format, dtype, tokenizer hash, counts, and per-file sizes/sha256

Every document is stored as ``[bos] + tokens + [eos]``, packed back to back with no padding;
the files are simply consecutive pieces of that one stream. The directory is built under a
temporary name and renamed into place at the end, so a directory with a manifest is complete.
"""

import hashlib
import json
import os
import secrets
import shutil
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
from tqdm import tqdm

from yatrain.data.corpus import default_corpus_files, expand_inputs, iter_documents
from yatrain.data.tokenizer import Tokenizer, file_sha256, train_tokenizer
from yatrain.errors import DataError

FORMAT = "yatrain-tokens-v1"
MANIFEST = "manifest.json"
TOKENIZER = "tokenizer.model"
_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
_VERIFY_MAX_BYTES = 512 * 2**20  # above this, hashing every shard on open costs too much
_BATCH_DOCS, _BATCH_CHARS = 1000, 4_000_000  # encode_batch granularity: speed vs memory


def token_dtype(vocab_size: int) -> str:
    """The narrowest dtype name that holds every id of a ``vocab_size`` vocabulary."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


class _ShardWriter:
    """Appends tokens to ``tokens-NNNNN.bin`` files of at most ``shard_tokens`` tokens each."""

    def __init__(self, directory: Path, dtype: str, shard_tokens: int):
        self.directory, self.dtype, self.shard_tokens = directory, _DTYPES[dtype], shard_tokens
        self.files: list[dict] = []
        self._digests: list = []

    def write(self, tokens: np.ndarray) -> None:
        tokens = tokens.astype(self.dtype, copy=False)
        while len(tokens):
            if not self.files or self.files[-1]["num_tokens"] == self.shard_tokens:
                self.files.append({"name": f"tokens-{len(self.files):05d}.bin", "num_tokens": 0})
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


def _batches(documents: Iterable[str]) -> Iterator[list[str]]:
    batch, chars = [], 0
    for doc in documents:
        batch.append(doc)
        chars += len(doc)
        if len(batch) >= _BATCH_DOCS or chars >= _BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def prepare_data(
    output: Path,
    inputs: list[Path] | None,
    tokenizer: Path | None = None,
    vocab_size: int | None = None,
    shard_tokens: int = 50_000_000,
    progress: bool = True,
) -> dict:
    """Tokenize ``inputs`` (default: the stdlib corpus) into a new data directory ``output``.

    Either copies an existing ``tokenizer`` model or trains one with ``vocab_size`` pieces on
    the same documents. Returns the manifest. Nothing is left behind if anything fails.
    """
    output = Path(output)
    if (tokenizer is None) == (vocab_size is None):
        raise DataError(
            "pass exactly one of a tokenizer model to reuse (--tokenizer) or a vocab size "
            "to train a new one (--vocab-size)"
        )
    if shard_tokens < 1:
        raise DataError(f"shard_tokens must be positive, got {shard_tokens}")
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise DataError(f"output {output} already exists: choose another directory or delete it")
    paths = expand_inputs(inputs) if inputs else default_corpus_files()
    if next(iter_documents(paths), None) is None:
        raise DataError("the inputs contain no text (no non-empty documents): check --input")

    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.parent / f".tmp-{output.name}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        manifest = _build(tmp, paths, tokenizer, vocab_size, shard_tokens, progress)
        try:
            os.rename(tmp, output)  # atomic; replaces ``output`` only if it is an empty dir
        except OSError:
            raise DataError(
                f"output {output} appeared while preparing data: choose another directory"
            ) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _install_tokenizer(
    model: Path, paths: list[Path], tokenizer: Path | None, vocab_size: int | None, progress: bool
) -> Tokenizer:
    """Copy the given tokenizer model to ``model``, or train one there on ``paths``."""
    if vocab_size is not None:
        start = time.perf_counter()
        if progress:
            print(f"training a {vocab_size}-piece BPE tokenizer...", file=sys.stderr)
        train_tokenizer(iter_documents(paths), model.with_suffix(""), vocab_size)
        if progress:
            print(f"tokenizer trained in {time.perf_counter() - start:.1f}s", file=sys.stderr)
    else:
        Tokenizer(tokenizer)  # fail early, with a clear message, on a bad model
        shutil.copyfile(tokenizer, model)
    return Tokenizer(model)


def _build(
    tmp: Path,
    paths: list[Path],
    tokenizer: Path | None,
    vocab_size: int | None,
    shard_tokens: int,
    progress: bool,
) -> dict:
    """Fill ``tmp`` with tokenizer, token files and manifest; returns the manifest."""
    tok = _install_tokenizer(tmp / TOKENIZER, paths, tokenizer, vocab_size, progress)
    dtype = token_dtype(tok.vocab_size)
    writer = _ShardWriter(tmp, dtype, shard_tokens)

    start, num_documents, num_tokens = time.perf_counter(), 0, 0
    bar = tqdm(
        desc="tokenizing", unit="tok", unit_scale=True, file=sys.stderr, disable=not progress
    )
    for batch in _batches(iter_documents(paths)):
        flat: list[int] = []
        for ids in tok.encode_batch(batch):
            flat.append(tok.bos_id)
            flat.extend(ids)
            flat.append(tok.eos_id)
        writer.write(np.array(flat, dtype=np.int64))
        num_documents += len(batch)
        num_tokens += len(flat)
        bar.update(len(flat))
        bar.set_postfix(docs=num_documents)
    bar.close()
    files = writer.close()
    seconds = time.perf_counter() - start
    if num_tokens == 0:
        raise DataError("the inputs produced no tokens: check --input")

    manifest = {
        "format": FORMAT,
        "dtype": dtype,
        "tokenizer_sha256": tok.sha256,
        "vocab_size": tok.vocab_size,
        "bos_id": tok.bos_id,
        "eos_id": tok.eos_id,
        "num_documents": num_documents,
        "num_tokens": num_tokens,
        "files": files,
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    print(
        f"tokenized {num_documents:,} documents into {num_tokens:,} tokens in {seconds:.1f}s "
        f"({num_tokens / max(seconds, 1e-9):,.0f} tokens/s), {len(files)} file(s)",
        file=sys.stderr,
    )
    return manifest


class TokenShards:
    """Read-only view of a data directory as one long token stream (memory-mapped)."""

    def __init__(self, path: Path, manifest: dict, arrays: list[np.ndarray]):
        self.path, self.manifest, self._arrays = path, manifest, arrays
        sizes = np.array([len(a) for a in arrays], dtype=np.int64)
        self._ends = np.cumsum(sizes)
        self._starts = self._ends - sizes
        self.vocab_size: int = manifest["vocab_size"]
        self.num_tokens: int = manifest["num_tokens"]
        self.tokenizer_sha256: str = manifest["tokenizer_sha256"]
        self.tokenizer_path: Path = path / TOKENIZER

    @classmethod
    def open(cls, path: Path, verify_checksums: bool | None = None) -> "TokenShards":
        """Open and validate a data directory; checksums are verified by default up to 512 MB."""
        path = Path(path)
        if not (path / MANIFEST).is_file():
            raise DataError(
                f"no tokenized data at {path}: run `yatrain prepare-data --output {path}` first"
            )
        manifest = _load_manifest(path / MANIFEST)
        dtype = _DTYPES[manifest["dtype"]]
        total_bytes = manifest["num_tokens"] * dtype.itemsize
        if verify_checksums is None:
            verify_checksums = total_bytes <= _VERIFY_MAX_BYTES
        fix = f"re-run `yatrain prepare-data` into a new directory to rebuild {path}"

        model = path / TOKENIZER
        if not model.is_file():
            raise DataError(f"{model} is missing: {fix}")
        if file_sha256(model) != manifest["tokenizer_sha256"]:
            raise DataError(f"{model} does not match the tokenizer_sha256 in the manifest: {fix}")

        arrays = []
        for entry in manifest["files"]:
            file = path / entry["name"]
            if not file.is_file():
                raise DataError(f"token file {file} is missing: {fix}")
            expected = entry["num_tokens"] * dtype.itemsize
            if file.stat().st_size != expected:
                raise DataError(
                    f"token file {file} has {file.stat().st_size} bytes, the manifest says "
                    f"{expected} (truncated or overwritten?): {fix}"
                )
            if verify_checksums and file_sha256(file) != entry["sha256"]:
                raise DataError(f"token file {file} fails its sha256 check (corrupted): {fix}")
            arrays.append(np.memmap(file, dtype=dtype, mode="r"))
        return cls(path, manifest, arrays)

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` of the whole stream as int64, across files."""
        if start < 0 or length < 0 or start + length > self.num_tokens:
            raise IndexError(f"read({start}, {length}) outside [0, {self.num_tokens})")
        out = np.empty(length, dtype=np.int64)
        i = int(np.searchsorted(self._ends, start, side="right"))
        done = 0
        while done < length:
            local = start + done - int(self._starts[i])
            take = min(length - done, len(self._arrays[i]) - local)
            out[done : done + take] = self._arrays[i][local : local + take]
            done += take
            i += 1
        return out

    def __repr__(self) -> str:
        return f"TokenShards({str(self.path)!r}, num_tokens={self.num_tokens:,})"


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
    if manifest["dtype"] not in _DTYPES or manifest["dtype"] != token_dtype(manifest["vocab_size"]):
        raise DataError(
            f"{file} has dtype {manifest['dtype']!r} for vocab size {manifest['vocab_size']}: {fix}"
        )
    for entry in manifest["files"]:
        ok = isinstance(entry, dict) and isinstance(entry.get("name"), str)
        ok = ok and isinstance(entry.get("num_tokens"), int) and entry["num_tokens"] > 0
        ok = ok and isinstance(entry.get("sha256"), str) and "/" not in entry["name"]
        if not ok:
            raise DataError(f"{file} has an invalid files entry {entry!r}: {fix}")
    if sum(e["num_tokens"] for e in manifest["files"]) != manifest["num_tokens"]:
        raise DataError(f"{file}: num_tokens differs from the sum over its files: {fix}")
    return manifest
