"""The streaming stage of ``prepare_data``: a corpus tokenized into token shards in a folder.

Documents go in chunks to the tokenizer workers (``encode_stream``) and each chunk's tokens
are appended to the training or the validation shards as they arrive, so memory stays flat
whatever the corpus size. ``tokenize_into`` is also what the tokenization benchmark times.
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from yatrain.data.corpus import Corpus
from yatrain.data.manifest import token_dtype
from yatrain.data.parallel import encode_stream
from yatrain.data.shards import ShardWriter
from yatrain.data.split import Packed
from yatrain.data.tokenizer import Tokenizer


@dataclass
class Split:
    """One split's token files and counts, as the manifest records them."""

    files: list[dict]
    num_documents: int = 0
    num_tokens: int = 0

    def to_json(self) -> dict:
        return {
            "num_documents": self.num_documents,
            "num_tokens": self.num_tokens,
            "files": self.files,
        }


@dataclass
class Tokenized:
    """What ``tokenize_into`` wrote (the training and validation splits), and how long it
    took."""

    train: Split
    val: Split
    seconds: float

    @property
    def num_tokens(self) -> int:
        return self.train.num_tokens + self.val.num_tokens

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / max(self.seconds, 1e-9)


def tokenize_into(
    folder: Path,
    corpus: Corpus,
    tok: Tokenizer,
    shard_tokens: int,
    workers: int,
    threads: int = 1,
    progress: bool = False,
    val_fraction: float = 0.0,
) -> Tokenized:
    """Read, tokenize and write the corpus as token shards in ``folder``, ``val_fraction`` of
    the documents into the validation split (the stage the progress bar and the throughput
    benchmark time)."""
    dtype = token_dtype(tok.vocab_size)
    writers = (
        ShardWriter(folder, dtype, shard_tokens),
        ShardWriter(folder, dtype, shard_tokens, "val"),
    )
    train, val = Split([]), Split([])
    start = time.perf_counter()
    stream = encode_stream(tok, corpus.documents(), np.dtype(dtype), workers, threads, val_fraction)
    bar = tqdm(
        desc="tokenizing", unit="tok", unit_scale=True, file=sys.stderr, disable=not progress
    )
    with contextlib.closing(stream):  # ends the workers at once if this stops early
        for chunk in stream:
            _write_chunk(chunk, writers, (train, val), bar)
    bar.close()
    train.files, val.files = writers[0].close(), writers[1].close()
    return Tokenized(train, val, time.perf_counter() - start)


def _write_chunk(chunk: Packed, writers: tuple, splits: tuple[Split, Split], bar: tqdm) -> None:
    """One tokenized chunk into the training and validation shards."""
    train, val = splits
    for writer, split, tokens, docs in [
        (writers[0], train, chunk.train, chunk.train_documents),
        (writers[1], val, chunk.val, chunk.val_documents),
    ]:
        writer.write(tokens)
        split.num_documents += docs
        split.num_tokens += len(tokens)
        bar.update(len(tokens))
    bar.set_postfix(docs=f"{train.num_documents + val.num_documents:,}", refresh=False)
