"""The tokenized data set on disk: its format, and its manifest read and checked.

A data directory holds::

    tokenizer.model       the tokenizer the tokens were produced with (sentencepiece or
                          tiktoken), or tokenizer.json + tokenizer_config.json (Hugging Face)
    tokens-00000.bin ...  raw little-endian uint16 (vocab <= 65536) or uint32 token ids
    val-00000.bin ...     the validation split (held-out documents), in the same format
    manifest.json         format, dtype, tokenizer kind/hash/BOS/EOS/vocabulary, counts,
                          skipped inputs, per-file sizes/sha256, and the validation split's
                          counts and files (``validation``: null when none was held out)
    file-index.*          the manifest's file lists as arrays, for start-up at any file
                          count (``data/file_index.py``; absent in older directories)

Every document is stored as ``[bos] + tokens + [eos]``, packed back to back with no padding;
the files of a split are simply consecutive pieces of that one stream. The top-level counts
and ``files`` are the training split. The directory is built under a temporary name and
renamed into place at the end, so a directory with a manifest is complete. A data set
prepared in parts (``prepare-data --shard I/N``, then ``--merge``) keeps each part's files
under ``parts/``; its manifest names them by their path below the directory.
"""

import json
import re
from pathlib import Path

import numpy as np

from yatrain.errors import DataError

FORMAT = "yatrain-tokens-v1"
MANIFEST = "manifest.json"
TOKENIZER = "tokenizer.model"  # the tokenizer file of data prepared before tokenizer kinds
TOKENIZER_KINDS = ("sentencepiece", "tiktoken", "hf")
TOKEN_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


def token_dtype(vocab_size: int) -> str:
    """The narrowest dtype name that holds every id of a ``vocab_size`` vocabulary."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


def split_entry(manifest: dict, split: str) -> dict | None:
    """A split's ``num_documents``, ``num_tokens`` and ``files``; None when it has none."""
    if split == "train":
        return manifest
    return manifest.get("validation")


def load_manifest(path: Path, part: bool = False) -> dict:
    """The checked manifest of the data directory ``path``; one part of a data set prepared
    in parts (``prepare-data --shard``) is not a data set to use (only the merge, ``part``,
    reads one)."""
    path = Path(path)
    if not (path / MANIFEST).is_file():
        raise DataError(_no_data(path))
    manifest = _load_manifest(path / MANIFEST)
    if not part:
        refuse_part(path, manifest)
    return manifest


def refuse_part(path: Path, manifest: dict) -> None:
    """One part of a data set prepared in parts is not a data set to train on."""
    record = manifest.get("part")
    if isinstance(record, dict):
        root = path.parent.parent if path.parent.name == "parts" else path.parent
        raise DataError(
            f"{path} is part {record.get('index')}/{record.get('count')} of a data set "
            f"prepared in parts (prepare-data --shard), not the whole: run `yatrain "
            f"prepare-data --merge {root}` once every part is done and use {root}"
        )


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
    if manifest["dtype"] not in TOKEN_DTYPES or manifest["dtype"] != token_dtype(
        manifest["vocab_size"]
    ):
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
