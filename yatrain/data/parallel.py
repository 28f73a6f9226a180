"""Tokenizing a stream of documents in worker processes, in order, in bounded memory.

The reading process cuts the documents into chunks of about 256K characters and
numbers them; N workers take chunks from one queue as they become free (so a long chunk
does not hold the others up) and the reading process puts the results back in chunk order,
so the output is byte-identical for any N. At most ``4 N`` chunks are read ahead of the
writer, whatever the corpus size. Each worker encodes on one thread and returns its chunk
packed as ``[bos] doc [eos] [bos] doc [eos] ...`` in the token dtype, ready to be written,
split into training and held-out documents (``split.pack_split``).

When the stream is not read to its end (an error, Ctrl-C, SIGTERM) the workers are ended at
once rather than left to finish their chunks; on Linux a worker also ends when its parent
dies, however it dies, so none is ever left behind as an orphan.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import queue
import signal
import sys
from collections.abc import Iterable, Iterator

import numpy as np

from yatrain.data.split import Packed, pack_split
from yatrain.data.tokenizer import Tokenizer
from yatrain.errors import DataError

CHUNK_CHARS = 1 << 18  # text per chunk: enough to amortise the hand-over, small for balance
CHUNK_DOCS = 4096
_IN_FLIGHT_PER_WORKER = 4  # chunks read ahead per worker: slack for uneven chunks
_POLL_S = 1.0


def default_workers() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def chunks(documents: Iterable[str]) -> Iterator[list[str]]:
    """Consecutive documents grouped into chunks of about ``CHUNK_CHARS`` characters."""
    chunk, chars = [], 0
    for doc in documents:
        chunk.append(doc)
        chars += len(doc)
        if chars >= CHUNK_CHARS or len(chunk) >= CHUNK_DOCS:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


_PR_SET_PDEATHSIG = 1


def _end_with_parent(parent: int) -> None:
    """Linux: have the kernel send SIGTERM to this worker when its parent dies."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)


def _worker(
    tokenizer: Tokenizer, dtype: np.dtype, val_fraction: float, inbox, outbox, parent: int
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops us
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the parent's handler: just end
    _end_with_parent(parent)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker
    while (task := inbox.get()) is not None:
        index, docs = task
        try:
            outbox.put((index, pack_split(tokenizer, docs, dtype, 1, val_fraction)))
        except Exception as e:  # reported by the parent as one line
            outbox.put((index, f"{type(e).__name__}: {str(e).strip()[:300]}"))


class _Pool:
    """N processes taking numbered chunks from one queue as they become free; the parent
    puts the results back in order."""

    def __init__(self, tokenizer: Tokenizer, dtype: np.dtype, workers: int, val_fraction: float):
        # fork: a worker starts in milliseconds with the tokenizer already loaded. Elsewhere
        # the tokenizer is pickled as its path and reloaded in each worker.
        method = "fork" if sys.platform.startswith("linux") else "spawn"
        context = mp.get_context(method)
        self.inbox, self.outbox = context.Queue(), context.Queue()
        self.processes = [
            context.Process(
                target=_worker,
                args=(tokenizer, dtype, val_fraction, self.inbox, self.outbox, os.getpid()),
                daemon=True,
                name=f"yatrain-tokenize-{i}",
            )
            for i in range(workers)
        ]
        for process in self.processes:
            process.start()
        self.done: dict[int, Packed] = {}

    def submit(self, index: int, docs: list[str]) -> None:
        self.inbox.put((index, docs))

    def result(self, index: int) -> Packed:
        """The result of chunk ``index``, keeping the others that arrive meanwhile."""
        while index not in self.done:
            try:
                got, answer = self.outbox.get(timeout=_POLL_S)
            except queue.Empty:
                for number, process in enumerate(self.processes):
                    if not process.is_alive():
                        raise DataError(
                            f"tokenizer worker {number} died (exit code {process.exitcode}; "
                            "out of memory?): retry with fewer --workers"
                        ) from None
                continue
            if isinstance(answer, str):
                raise DataError(f"tokenizing failed in a worker: {answer}")
            self.done[got] = answer
        return self.done.pop(index)

    def close(self, finished: bool = True) -> None:
        """End the workers: after their last chunk, or (not ``finished``) at once."""
        if finished:
            for _ in self.processes:
                self.inbox.put(None)
        for process in self.processes:
            process.join(timeout=5 if finished else 0)
            if process.is_alive():
                process.terminate()
        for process in self.processes:
            process.join(timeout=2)
            if process.is_alive():
                process.kill()
                process.join()
        for q in (self.inbox, self.outbox):
            q.cancel_join_thread()  # chunks nobody will read must not block our exit
            q.close()


def encode_stream(
    tokenizer: Tokenizer,
    documents: Iterable[str],
    dtype: np.dtype,
    workers: int = 1,
    threads: int = 1,
    val_fraction: float = 0.0,
) -> Iterator[Packed]:
    """Each chunk of ``documents`` packed, split by ``val_fraction``, in order.

    ``workers`` processes encode on one thread each, started right away (before the caller
    starts threads of its own, such as a progress bar's); ``workers == 1`` encodes in this
    process on ``threads`` threads (the benchmark's single-process baseline).
    """
    if workers <= 1:
        return (
            pack_split(tokenizer, docs, dtype, threads, val_fraction) for docs in chunks(documents)
        )
    return _in_order(_Pool(tokenizer, dtype, workers, val_fraction), documents, workers)


def _in_order(pool: _Pool, documents: Iterable[str], workers: int):
    limit = _IN_FLIGHT_PER_WORKER * workers
    taken = submitted = 0
    finished = False
    try:
        for index, docs in enumerate(chunks(documents)):
            if index - taken == limit:  # bounded: read ahead at most `limit` chunks
                yield pool.result(taken)
                taken += 1
            pool.submit(index, docs)
            submitted = index + 1
        for index in range(taken, submitted):
            yield pool.result(index)
        finished = True
    finally:
        pool.close(finished)
