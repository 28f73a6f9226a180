"""Run a function on N fresh rank processes, each in its own new process group.

The benchmarks start every repeat in fresh processes, and the tests run multi-rank code on
fork-started gloo ranks; both go through ``run_ranks``. A rank that fails reports its
traceback to the parent instead of hanging it.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import socket
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist


class RankFailed(RuntimeError):
    """A rank raised; the message holds its traceback."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, world, port, backend, threads, fn, args, queue) -> None:
    try:
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
        )
        torch.set_num_threads(threads)
        if backend == "nccl":  # one GPU per rank, chosen before the group binds to one
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world)
        try:
            result = fn(rank, world, *args)
            dist.barrier()
        finally:
            dist.destroy_process_group()
        payload = io.BytesIO()
        torch.save(result, payload)  # plain bytes: tensors must outlive this process
        queue.put((rank, "ok", payload.getvalue()))
    except BaseException:  # report to the parent instead of hanging it
        queue.put((rank, "error", traceback.format_exc()))


def run_ranks(
    world: int,
    fn: Callable,
    *args,
    backend: str = "gloo",
    threads: int = 1,
    start_method: str = "fork",
    timeout: float = 900.0,
) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` fresh processes with ``threads`` torch
    threads each; returns the results in rank order. ``fn`` must be a module-level function
    when ``start_method`` is ``spawn`` (needed on CUDA). Raises ``RankFailed`` with the
    rank's traceback if any rank fails."""
    ctx = mp.get_context(start_method)
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, world, port, backend, threads, fn, args, queue))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    try:
        for _ in range(world):
            rank, status, payload = queue.get(timeout=timeout)
            if status != "ok":
                raise RankFailed(f"rank {rank} failed:\n{payload}")
            results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    return [results[r] for r in range(world)]
