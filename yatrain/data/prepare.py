"""``prepare_data``: documents in, a complete tokenized data directory out (or nothing).

The corpus is read once to train a tokenizer (with ``vocab_size``) and once to tokenize it,
streaming both times: documents go in chunks to the tokenizer workers and shards are written
as they fill. ``val_fraction`` of the documents (chosen by their content, ``split.held_out``)
go to a validation split instead, which a trained tokenizer never sees. Everything is built
in a hidden temporary directory that is renamed into place only when the manifest is
written; any failure removes it, and so does SIGTERM or Ctrl-C (the CLI turns SIGTERM into an
interrupt): the workers end and one line says so; a full disk is named with the output. The
temporary directory holds a lock while it is in use, so the ones of an earlier run that was
killed are recognised and removed. An output that is a link, or lies inside an input
directory, is refused before any work.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import secrets
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from yatrain.data.corpus import Corpus, ReadStats
from yatrain.data.file_index import write_file_index
from yatrain.data.manifest import FORMAT, MANIFEST, token_dtype
from yatrain.data.parallel import default_workers
from yatrain.data.split import DEFAULT_VAL_FRACTION, held_out
from yatrain.data.tokenize_shards import Tokenized, tokenize_into
from yatrain.data.tokenizer import Tokenizer
from yatrain.data.tokenizer_formats import load_tokenizer
from yatrain.data.tokenizer_sentencepiece import train_tokenizer
from yatrain.errors import DataError, Interrupted

_LISTED_FILES = 5  # skipped files named in the summary line (the manifest has them all)
_TMP_LOCK = ".prepare.lock"  # held in the temporary directory while it is being written
_DISK_FULL = {errno.ENOSPC, errno.EDQUOT}


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
    val_fraction: float = DEFAULT_VAL_FRACTION,
) -> dict:
    """Tokenize ``inputs`` (default: the stdlib corpus) into a new data directory ``output``.

    Either encodes with an existing ``tokenizer`` (sentencepiece, tiktoken or tokenizer.json)
    or trains a sentencepiece one with ``vocab_size`` pieces on the training documents.
    ``workers`` processes tokenize in parallel (default: one per core); the output does not
    depend on their number. ``val_fraction`` of the documents are held out as the validation
    split. Returns the manifest.
    """
    output = Path(output)
    if not 0 <= val_fraction < 1:
        raise DataError(f"--val-fraction must be at least 0 and below 1, got {val_fraction}")
    check_outside_inputs(output, inputs)
    workers = _check_arguments(
        output,
        tokenizer,
        vocab_size,
        shard_tokens,
        workers,
        bos_token is not None or eos_token is not None,
    )
    corpus = Corpus(inputs, text_field=text_field, skip_bad_records=skip_bad_records)
    source = None if tokenizer is None else load_tokenizer(tokenizer, bos_token, eos_token)
    if next(corpus.documents(), None) is None:
        raise DataError("the inputs contain no text (no non-empty documents): check --input")

    def build(tmp: Path) -> dict:
        tok, names = _store_tokenizer(tmp, corpus, source, vocab_size, progress, val_fraction)
        manifest = {"format": FORMAT, **tok.describe(), "tokenizer_files": names}
        options = Options(shard_tokens, workers, encode_threads, progress, val_fraction)
        return tokenize(tmp, manifest, corpus, tok, options)

    return build_into(output, build)


def build_into(output: Path, build: Callable[[Path], dict]) -> dict:
    """Run ``build`` on a new temporary directory and rename that to ``output`` when it
    returns (its result, the manifest, written); remove it on any failure or interrupt."""
    tmp, lock = _temporary(output)
    try:
        manifest = build(tmp)
        _move_into_place(tmp, output)
    except KeyboardInterrupt:
        shutil.rmtree(tmp, ignore_errors=True)
        raise Interrupted(
            f"prepare-data stopped; nothing was written (removed {tmp.name}): rerun it"
        ) from None
    except OSError as error:
        shutil.rmtree(tmp, ignore_errors=True)
        if error.filename is not None or error.errno not in _DISK_FULL:
            raise
        raise OSError(error.errno, error.strerror, str(output)) from None  # which disk
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        os.close(lock)
    return manifest


class OutputAppeared(DataError):
    """The output was made by someone else while this run prepared it."""


def check_outside_inputs(output: Path, inputs: list[Path] | None) -> None:
    """An output inside an input directory is refused: a rerun (or a later part) would read
    its token files as documents."""
    where = Path(os.path.abspath(output)).resolve()
    for path in inputs or []:
        folder = Path(os.path.abspath(path)).resolve()
        if folder.is_dir() and where.is_relative_to(folder):
            raise DataError(
                f"--output {output} is inside --input {path}: its files would be read as "
                f"input; choose an --output outside {path}"
            )


def _check_arguments(
    output: Path,
    tokenizer: Path | None,
    vocab_size: int | None,
    shard_tokens: int,
    workers: int | None,
    special_tokens: bool,
) -> int:
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
    if output.is_symlink():
        raise DataError(
            f"output {output} is a symbolic link (to {os.readlink(output)}): prepare-data "
            "writes a new directory and never through a link; pass the directory it points "
            "to, or another new path"
        )
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise DataError(f"output {output} already exists: choose another directory or delete it")
    return check_workers(workers)


def check_workers(workers: int | None) -> int:
    """The number of tokenizer workers: one per usable core unless given (at most that)."""
    cpus = default_workers()
    workers = cpus if workers is None else workers
    if not 1 <= workers <= cpus:
        raise DataError(
            f"--workers {workers}: pass 1 to {cpus} (the CPUs this process may use); more "
            "workers than CPUs only slow it down"
        )
    return workers


def _temporary(output: Path) -> tuple[Path, int]:
    """A new hidden directory next to ``output``, and the lock held on it while in use
    (those of killed earlier runs removed first)."""
    output.parent.mkdir(parents=True, exist_ok=True)
    for line in remove_stale_temporaries(output):
        print(line, file=sys.stderr)
    tmp = output.parent / f".tmp-{output.name}-{secrets.token_hex(4)}"
    tmp.mkdir()
    lock = os.open(tmp / _TMP_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return tmp, lock


def _move_into_place(tmp: Path, output: Path) -> None:
    """Rename the complete temporary directory to ``output``, its lock file removed first."""
    (tmp / _TMP_LOCK).unlink()
    try:
        os.rename(tmp, output)  # atomic; replaces ``output`` only if it is an empty dir
    except OSError:
        raise OutputAppeared(
            f"output {output} appeared while preparing data: choose another directory"
        ) from None


def remove_stale_temporaries(output: Path) -> list[str]:
    """Remove the temporary directories of earlier runs for ``output`` that were killed
    (their lock is free); name those that cannot be told apart from a live run's."""
    lines = []
    for tmp in sorted(output.parent.glob(f".tmp-{output.name}-*")):
        try:
            lock = os.open(tmp / _TMP_LOCK, os.O_RDWR)
        except OSError:
            lines.append(
                f"note: {tmp} was left by an earlier prepare-data: delete it if no "
                "prepare-data is running"
            )
            continue
        try:
            with contextlib.suppress(BlockingIOError):  # held: another run is writing it
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                shutil.rmtree(tmp, ignore_errors=True)
                lines.append(f"removed {tmp}, left by an earlier prepare-data that was stopped")
        finally:
            os.close(lock)
    return lines


def _store_tokenizer(
    tmp: Path,
    corpus: Corpus,
    source: Tokenizer | None,
    vocab_size: int | None,
    progress: bool,
    val_fraction: float,
) -> tuple[Tokenizer, list[str]]:
    """Copy or train the tokenizer into ``tmp``: the tokenizer, and the names of its files
    there (the vocabulary file, whose hash identifies it, first). A trained tokenizer sees
    the training documents only."""
    if source is None:
        start = time.perf_counter()
        if progress:
            print(f"training a {vocab_size}-piece BPE tokenizer...", file=sys.stderr)
        documents = (d for d in corpus.documents() if not held_out(d, val_fraction))
        train_tokenizer(documents, tmp / "tokenizer", vocab_size)
        if progress:
            print(f"tokenizer trained in {time.perf_counter() - start:.1f}s", file=sys.stderr)
        return load_tokenizer(tmp / "tokenizer.model"), ["tokenizer.model"]
    return source, source.save(tmp)


@dataclass
class Options:
    shard_tokens: int
    workers: int
    threads: int
    progress: bool
    val_fraction: float


def tokenize(
    tmp: Path, manifest: dict, corpus: Corpus, tok: Tokenizer, options: Options, whole: bool = True
) -> dict:
    """Write the token shards into ``tmp`` and complete and write ``manifest``; a part of a
    partitioned corpus (not ``whole``) may hold no tokens (the merge checks the total)."""
    done = tokenize_into(
        tmp,
        corpus,
        tok,
        options.shard_tokens,
        options.workers,
        options.threads,
        options.progress,
        options.val_fraction,
    )
    if whole:
        check_tokens(done.num_tokens, done.train.num_tokens, options.val_fraction)
    stats = corpus.stats
    manifest = {
        **manifest,
        "dtype": token_dtype(tok.vocab_size),
        **done.train.to_json(),
        "val_fraction": options.val_fraction,
        "validation": done.val.to_json() if done.val.num_tokens else None,
        "skipped_bad_records": stats.bad_records,
        "first_bad_record": stats.first_bad_record,
        "skipped_files": [{"path": path, "reason": why} for path, why in stats.not_text],
        "empty_documents": stats.empty_documents,
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    write_file_index(tmp, manifest)
    workers = options.workers
    print(
        f"tokenized {_count(done.train.num_documents + done.val.num_documents, 'document')} into "
        f"{done.num_tokens:,} tokens in {done.seconds:.1f}s ({done.tokens_per_s:,.0f} tokens/s, "
        f"{workers} worker{'s' if workers > 1 else ''}), {len(done.train.files)} file(s)"
        f"{_held_out(done, options.val_fraction)}{_skipped(stats)}",
        file=sys.stderr,
    )
    return manifest


def check_tokens(total: int, train: int, val_fraction: float) -> None:
    """A data set with no tokens, or none left to train on, is refused."""
    if total == 0:
        raise DataError("the inputs produced no tokens: check --input")
    if train == 0:
        raise DataError(
            f"--val-fraction {val_fraction} held out every document, leaving none to "
            "train on: lower it"
        )


def _count(number: int, thing: str) -> str:
    """``1 document``, ``2 documents``."""
    return f"{number:,} {thing}{'' if number == 1 else 's'}"


def _held_out(done: Tokenized, val_fraction: float) -> str:
    if val_fraction == 0:
        return "; no validation split (--val-fraction 0)"
    if done.val.num_documents == 0:
        return (
            f"; --val-fraction {val_fraction} held out no document (too few documents): no "
            "validation split"
        )
    return (
        f"; held out {_count(done.val.num_documents, 'document')} ({done.val.num_tokens:,} tokens) "
        "as the validation split"
    )


def _skipped(stats: ReadStats) -> str:
    parts = []
    if stats.empty_documents:
        parts.append(f"; dropped {stats.empty_documents:,} empty (whitespace-only) document(s)")
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
