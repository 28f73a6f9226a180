"""A prepared data directory of any size at no disk cost: sparse token files (zeros, real
sizes) under a real manifest, for tests and benchmarks of the data path at the corpus sizes
users train on (15T tokens in 300,000 files of ``prepare-data``'s 50M tokens)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

from yatrain.data.file_index import write_file_index
from yatrain.data.manifest import FORMAT, MANIFEST, load_manifest, token_dtype

_PLACEHOLDER_SHA256 = "0" * 64  # never checked: data over 512 MB is not hashed on open


def write_sparse_corpus(
    path: Path, num_files: int, tokens_per_file: int, tokenizer_from: Path
) -> dict:
    """Write ``num_files`` sparse token files of ``tokens_per_file`` zeros each into the new
    directory ``path``, with the tokenizer (and its facts) of the prepared data directory
    ``tokenizer_from``; returns the manifest written."""
    source = load_manifest(tokenizer_from)
    path.mkdir(parents=True)
    for name in source.get("tokenizer_files", ["tokenizer.model"]):
        shutil.copyfile(tokenizer_from / name, path / name)
    itemsize = np.dtype(token_dtype(source["vocab_size"])).itemsize
    files = []
    for index in range(num_files):
        name = f"tokens-{index:05d}.bin"
        with open(path / name, "wb") as f:
            f.truncate(tokens_per_file * itemsize)
        files.append({"name": name, "num_tokens": tokens_per_file, "sha256": _PLACEHOLDER_SHA256})
    facts = ("tokenizer_kind", "tokenizer_files", "tokenizer_sha256", "vocab_size")
    manifest = {
        "format": FORMAT,
        "dtype": token_dtype(source["vocab_size"]),
        **{key: source[key] for key in facts if key in source},
        "bos_id": source["bos_id"],
        "eos_id": source["eos_id"],
        "num_documents": num_files,
        "num_tokens": num_files * tokens_per_file,
        "files": files,
        "validation": None,
    }
    tmp = path / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest))
    os.replace(tmp, path / MANIFEST)
    write_file_index(path, manifest)
    return manifest
