"""Tokenizing a stream of documents in worker processes, in order, in bounded memory.

The reading process cuts the documents into chunks of about a megabyte of text and deals
them round-robin to N workers; chunk ``i`` goes to worker ``i % N`` and its tokens are taken
back from that worker in the same turn, so results come out in input order and the output
is byte-identical for any N. At most ``2 N`` chunks are in flight, whatever the corpus
size. Each worker encodes on one thread and returns its chunk packed as
``[bos] doc [eos] [bos] doc [eos] ...`` in the token dtype, ready to be written.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import sys
from collections import deque
from collections.abc import Iterable, Iterator

import numpy as np

from yatrain.data.tokenizer import Tokenizer
from yatrain.errors import DataError

CHUNK_CHARS = 1 << 20  # text per chunk: large enough to amortise the hand-over
CHUNK_DOCS = 4096
_IN_FLIGHT_PER_WORKER = 2
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


def pack(tokenizer: Tokenizer, docs: list[str], dtype: np.dtype, threads: int = 1) -> np.ndarray:
    """The chunk's documents as one array: each one's ids between BOS and EOS."""
    flat: list[int] = []
    bos, eos = tokenizer.bos_id, tokenizer.eos_id
    for ids in tokenizer.encode_batch(docs, threads=threads):
        flat.append(bos)
        flat.extend(ids)
        flat.append(eos)
    return np.array(flat, dtype=dtype)


def _worker(tokenizer: Tokenizer, dtype: np.dtype, inbox, outbox) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops us
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker
    while (docs := inbox.get()) is not None:
        try:
            outbox.put((pack(tokenizer, docs, dtype), len(docs)))
        except Exception as e:  # reported by the parent as one line
            outbox.put(f"{type(e).__name__}: {str(e).strip()[:300]}")


class _Pool:
    """N processes with one inbox and one outbox each (round-robin keeps the order)."""

    def __init__(self, tokenizer: Tokenizer, dtype: np.dtype, workers: int):
        # fork: a worker starts in milliseconds with the tokenizer already loaded. Elsewhere
        # the tokenizer is pickled as its path and reloaded in each worker.
        method = "fork" if sys.platform.startswith("linux") else "spawn"
        context = mp.get_context(method)
        self.inboxes = [context.Queue() for _ in range(workers)]
        self.outboxes = [context.Queue() for _ in range(workers)]
        self.processes = [
            context.Process(
                target=_worker, args=(tokenizer, dtype, inbox, outbox), daemon=True,
                name=f"yatrain-tokenize-{i}",
            )
            for i, (inbox, outbox) in enumerate(zip(self.inboxes, self.outboxes, strict=True))
        ]  # fmt: skip
        for process in self.processes:
            process.start()

    def submit(self, index: int, docs: list[str]) -> None:
        self.inboxes[index % len(self.processes)].put(docs)

    def result(self, index: int) -> tuple[np.ndarray, int]:
        worker = index % len(self.processes)
        while True:
            try:
                answer = self.outboxes[worker].get(timeout=_POLL_S)
                break
            except queue.Empty:
                process = self.processes[worker]
                if not process.is_alive():
                    raise DataError(
                        f"tokenizer worker {worker} died (exit code {process.exitcode}; out of "
                        "memory?): retry with fewer --workers"
                    ) from None
        if isinstance(answer, str):
            raise DataError(f"tokenizing failed in worker {worker}: {answer}")
        return answer

    def close(self) -> None:
        for inbox, process in zip(self.inboxes, self.processes, strict=True):
            if process.is_alive():
                inbox.put(None)
        for process in self.processes:
            process.join(timeout=5)
            if process.is_alive():
                process.terminate()
                process.join()
        for q in (*self.inboxes, *self.outboxes):
            q.cancel_join_thread()  # chunks nobody will read must not block our exit
            q.close()


def encode_stream(
    tokenizer: Tokenizer,
    documents: Iterable[str],
    dtype: np.dtype,
    workers: int = 1,
    threads: int = 1,
) -> Iterator[tuple[np.ndarray, int]]:
    """(packed tokens, number of documents) per chunk of ``documents``, in order.

    ``workers`` processes encode on one thread each, started right away (before the caller
    starts threads of its own, such as a progress bar's); ``workers == 1`` encodes in this
    process on ``threads`` threads (the benchmark's single-process baseline).
    """
    if workers <= 1:
        return ((pack(tokenizer, docs, dtype, threads), len(docs)) for docs in chunks(documents))
    return _in_order(_Pool(tokenizer, dtype, workers), documents, workers)


def _in_order(pool: _Pool, documents: Iterable[str], workers: int):
    try:
        pending: deque[int] = deque()
        for index, docs in enumerate(chunks(documents)):
            if len(pending) == _IN_FLIGHT_PER_WORKER * workers:
                yield pool.result(pending.popleft())
            pool.submit(index, docs)
            pending.append(index)
        while pending:
            yield pool.result(pending.popleft())
    finally:
        pool.close()
