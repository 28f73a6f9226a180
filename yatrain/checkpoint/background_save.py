"""Asynchronous checkpoints (``checkpoint.async``): the step waits only for a copy in host memory.

A save copies this rank's state into host buffers (``dcp_io.HostStager``: pinned on a GPU,
allocated at the first save and reused) and returns; DCP writes the copy to ``.tmp-step-N``
from a thread of its own, and a thread of ours then completes the save exactly as a
synchronous one is completed (``checkpoint.complete_save``: every rank's file entries
gathered, rank 0 writes the manifest, renames to ``step-N`` and prunes). Both threads
communicate over one gloo process group of their own (a fake world's backend in a dry run),
so their collectives never interleave with the training's. At most one save is in flight:
the next save waits for it (and reuses its host buffers), as do the end of the run and a
stop. A process killed while writing leaves only ``.tmp-step-N``, which the next start
removes: the previous checkpoint stays the newest complete one.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.optim import Optimizer

from yatrain.checkpoint.dcp_io import AsyncWrite, HostStager, save_state_async
from yatrain.checkpoint.dcp_state import training_state
from yatrain.checkpoint.store import PendingSave, begin_save, complete_save
from yatrain.sharding import ShardedEngine
from yatrain.sharding.comm import host_backend


class AsyncSaver:
    """One rank's background checkpoint writes (see the module docstring). Building it is
    collective (it creates the process group the writes use)."""

    def __init__(self, device: torch.device, mesh: DeviceMesh | None, timeout_s: float) -> None:
        if mesh is None:
            raise RuntimeError("asynchronous checkpoints need a process group (one rank is enough)")
        self.mesh = mesh
        backend = host_backend()  # gloo, or the default group's (a fake world's)
        self.group = dist.new_group(backend=backend, timeout=timedelta(seconds=timeout_s))
        host_mesh = init_device_mesh(
            "cpu",
            tuple(mesh.shape),
            mesh_dim_names=mesh.mesh_dim_names,
            backend_override=dict.fromkeys(range(mesh.ndim), backend),
        )
        self.stager = HostStager(host_mesh, pinned=device.type == "cuda")
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="yatrain-ckpt")
        self._pending: tuple[int, Future[Path]] | None = None

    @property
    def in_flight(self) -> int | None:
        """The step whose save is being written (or finished but not yet waited for)."""
        return self._pending[0] if self._pending is not None else None

    def save(
        self,
        root: Path,
        step: int,
        engine: ShardedEngine,
        optimizer: Optimizer,
        meta: dict,
        *,
        is_main: bool,
        keep: int,
        tokenizer_files: Sequence[Path] = (),
    ) -> None:
        """Collective: ``save_checkpoint``'s asynchronous twin (after ``wait``): returns once
        the state is in host memory."""
        save = begin_save(
            root, step, engine, meta, is_main=is_main, keep=keep, tokenizer_files=tokenizer_files
        )
        self.start(save, training_state(engine, optimizer, self.mesh))

    def start(self, save: PendingSave, state: dict) -> None:
        """Copy ``state`` to host memory (the only part that blocks), then write and complete
        ``save`` in the background. The previous save must have been waited for."""
        if self._pending is not None:
            raise RuntimeError(f"the save of step {self._pending[0]} was not waited for")
        write = save_state_async(state, save.tmp, self.group, self.stager)
        self._pending = (save.step, self._executor.submit(_finish, save, write, self.group))

    def finished(self) -> bool:
        """Whether the save in flight has finished (never blocks)."""
        return self._pending is not None and self._pending[1].done()

    def failed(self) -> bool:
        """Whether the save in flight has finished with an error (never blocks)."""
        pending = self._pending
        return pending is not None and pending[1].done() and pending[1].exception() is not None

    def wait(self) -> Path | None:
        """The save in flight, once complete (None if there is none). Raises its failure:
        CheckpointError on every rank alike."""
        if self._pending is None:
            return None
        _, future = self._pending
        self._pending = None
        return future.result()

    def close(self) -> None:
        """Release the threads, the host buffers and the process group (after ``wait``)."""
        self._executor.shutdown(wait=True)
        self.stager.close()
        dist.destroy_process_group(self.group)


def _finish(save: PendingSave, write: AsyncWrite, group: dist.ProcessGroup) -> Path:
    """In the background: wait for DCP's write of this rank's shards, then complete the save
    (collective over ``group``)."""
    try:
        records: dict | BaseException = write.result()
    except (OSError, CheckpointException) as error:
        records = error
    return complete_save(save, records, group)
