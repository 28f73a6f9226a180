"""``prepare_data``: documents in, a complete tokenized data directory out (or nothing).

The corpus is read once to train a tokenizer (with ``vocab_size``) and once to tokenize it,
streaming both times: documents go in chunks to the tokenizer workers and shards are written
as they fill. Everything is built in a hidden temporary directory that is renamed into place
only when the manifest is written; any failure removes it.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from yatrain.data.corpus import Corpus, ReadStats
from yatrain.data.parallel import default_workers, encode_stream
from yatrain.data.shards import FORMAT, MANIFEST, ShardWriter, token_dtype
from yatrain.data.tokenizer import Tokenizer
from yatrain.data.tokenizer_formats import load_tokenizer
from yatrain.data.tokenizer_sentencepiece import train_tokenizer
from yatrain.errors import DataError

_LISTED_FILES = 5  # skipped files named in the summary line (the manifest has them all)


def prepare_data(
    output: Path,
    inputs: list[Path] | None,
    tokenizer: Path | None = None,
    vocab_size: int | None = None,
    shard_tokens: int = 50_000_000,
    progress: bool = True,
    *,
    text_field: str = "text",
    skip_bad_records: bool = False,
    workers: int | None = None,
    bos_token: str | None = None,
    eos_token: str | None = None,
    encode_threads: int = 1,
) -> dict:
    """Tokenize ``inputs`` (default: the stdlib corpus) into a new data directory ``output``.

    Either encodes with an existing ``tokenizer`` (sentencepiece, tiktoken or tokenizer.json)
    or trains a sentencepiece one with ``vocab_size`` pieces on the same documents.
    ``workers`` processes tokenize in parallel (default: one per core); the output does not
    depend on their number. Returns the manifest.
    """
    output = Path(output)
    workers = _check_arguments(output, tokenizer, vocab_size, shard_tokens, workers,
                               bos_token is not None or eos_token is not None)  # fmt: skip
    corpus = Corpus(inputs, text_field=text_field, skip_bad_records=skip_bad_records)
    source = None if tokenizer is None else load_tokenizer(tokenizer, bos_token, eos_token)
    if next(corpus.documents(), None) is None:
        raise DataError("the inputs contain no text (no non-empty documents): check --input")

    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.parent / f".tmp-{output.name}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        tok, names = _store_tokenizer(tmp, corpus, source, vocab_size, progress)
        manifest = {"format": FORMAT, **tok.describe(), "tokenizer_files": names}
        manifest = _tokenize(
            tmp, manifest, corpus, tok, shard_tokens, workers, encode_threads, progress
        )
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


def _check_arguments(
    output: Path, tokenizer: Path | None, vocab_size: int | None, shard_tokens: int,
    workers: int | None, special_tokens: bool,
) -> int:  # fmt: skip
    """Refuse impossible combinations before any work; returns the number of workers."""
    if (tokenizer is None) == (vocab_size is None):
        raise DataError(
            "pass exactly one of a tokenizer model to reuse (--tokenizer) or a vocab size "
            "to train a new one (--vocab-size)"
        )
    if vocab_size is not None and special_tokens:
        raise DataError("--bos-token/--eos-token choose tokens of an existing --tokenizer")
    if shard_tokens < 1:
        raise DataError(f"shard_tokens must be positive, got {shard_tokens}")
    workers = default_workers() if workers is None else workers
    if workers < 1:
        raise DataError(f"--workers must be at least 1, got {workers}")
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise DataError(f"output {output} already exists: choose another directory or delete it")
    return workers


def _store_tokenizer(
    tmp: Path, corpus: Corpus, source: Tokenizer | None, vocab_size: int | None, progress: bool
) -> tuple[Tokenizer, list[str]]:
    """Copy or train the tokenizer into ``tmp``: the tokenizer, and the names of its files
    there (the vocabulary file, whose hash identifies it, first)."""
    if source is None:
        start = time.perf_counter()
        if progress:
            print(f"training a {vocab_size}-piece BPE tokenizer...", file=sys.stderr)
        train_tokenizer(corpus.documents(), tmp / "tokenizer", vocab_size)
        if progress:
            print(f"tokenizer trained in {time.perf_counter() - start:.1f}s", file=sys.stderr)
        return load_tokenizer(tmp / "tokenizer.model"), ["tokenizer.model"]
    return source, source.save(tmp)


@dataclass
class Tokenized:
    """What ``tokenize_into`` wrote, and how long it took."""

    files: list[dict]
    num_documents: int
    num_tokens: int
    seconds: float

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
) -> Tokenized:
    """Read, tokenize and write the corpus as token shards in ``folder`` (the stage the
    progress bar and the throughput benchmark time)."""
    dtype = token_dtype(tok.vocab_size)
    writer = ShardWriter(folder, dtype, shard_tokens)
    start, num_documents, num_tokens = time.perf_counter(), 0, 0
    stream = encode_stream(tok, corpus.documents(), np.dtype(dtype), workers, threads)
    bar = tqdm(
        desc="tokenizing", unit="tok", unit_scale=True, file=sys.stderr, disable=not progress
    )
    for tokens, docs in stream:
        writer.write(tokens)
        num_documents += docs
        num_tokens += len(tokens)
        bar.update(len(tokens))
        bar.set_postfix(docs=f"{num_documents:,}", refresh=False)
    bar.close()
    files = writer.close()
    return Tokenized(files, num_documents, num_tokens, time.perf_counter() - start)


def _tokenize(
    tmp: Path,
    manifest: dict,
    corpus: Corpus,
    tok: Tokenizer,
    shard_tokens: int,
    workers: int,
    threads: int,
    progress: bool,
) -> dict:
    """Write the token shards into ``tmp`` and complete and write ``manifest``."""
    done = tokenize_into(tmp, corpus, tok, shard_tokens, workers, threads, progress)
    if done.num_tokens == 0:
        raise DataError("the inputs produced no tokens: check --input")
    stats = corpus.stats
    manifest = {
        **manifest,
        "dtype": token_dtype(tok.vocab_size),
        "num_documents": done.num_documents,
        "num_tokens": done.num_tokens,
        "skipped_bad_records": stats.bad_records,
        "first_bad_record": stats.first_bad_record,
        "skipped_files": [{"path": path, "reason": why} for path, why in stats.not_text],
        "files": done.files,
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    print(
        f"tokenized {done.num_documents:,} documents into {done.num_tokens:,} tokens in "
        f"{done.seconds:.1f}s ({done.tokens_per_s:,.0f} tokens/s, {workers} worker"
        f"{'s' if workers > 1 else ''}), {len(done.files)} file(s){_skipped(stats)}",
        file=sys.stderr,
    )
    return manifest


def _skipped(stats: ReadStats) -> str:
    parts = []
    if stats.bad_records:
        parts.append(
            f"; skipped {stats.bad_records:,} bad record(s), the first: {stats.first_bad_record}"
        )
    if stats.not_text:
        named = ", ".join(f"{Path(p).name} ({why})" for p, why in stats.not_text[:_LISTED_FILES])
        more = len(stats.not_text) - _LISTED_FILES
        named += f" and {more} more (see manifest.json)" if more > 0 else ""
        parts.append(f"; skipped {len(stats.not_text)} file(s) that are not text: {named}")
    return "".join(parts)
