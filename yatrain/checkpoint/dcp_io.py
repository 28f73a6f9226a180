"""Every DCP save and load of yatrain: hashed as it is written, read safely, and quiet.

- ``save_state`` writes through ``HashingWriter``: each rank hashes the bytes of its own files
  as they go to disk and returns their manifest entries (sizes, XXH3-64).
- ``save_state_async`` is DCP's ``async_save``: it returns once the state is copied to host
  memory by a ``HostStager`` (pinned on a GPU, reused from save to save), and DCP writes it
  from a thread of its own over a process group of its own (collectives of two threads must
  never share a group).
- ``load_state`` (collective) and ``load_alone`` (this process by itself: export,
  ``init_from``, evaluation) read through ``safe_load`` and never unpickle anything else.
- DCP warns on every call it makes without a process group. Rather than muting warnings, a
  process working alone gets what DCP asks for: a one-rank gloo group of its own, made for
  the call (a default group when there is none, else a subgroup of just this rank, on the
  default group's backend in a fake world: ``comm.host_backend``).
- DCP reports failures as ``CheckpointException``, a ``BaseException``; ``failure_message``
  turns it (or an ``OSError``) into the one line the user sees.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from yatrain.checkpoint.checksums import HashingStream
from yatrain.checkpoint.safe_load import SafeLoadPlanner, SafeReader, UnsafeCheckpoint
from yatrain.sharding.comm import host_backend


class HashingFileSystem(FileSystem):
    """DCP's local file system, recording each written file's size and checksum by name."""

    def __init__(self) -> None:
        super().__init__()
        self.records: dict[str, dict] = {}
        self._lock = threading.Lock()  # DCP may write files from several threads

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        path = Path(path)
        stream = HashingStream(path.open(mode))
        try:
            yield stream
        except BaseException:
            with contextlib.suppress(OSError):
                stream.close()
            if stream.failure is not None:  # torch's zip writer reports it as "unexpected pos"
                raise stream.failure from None
            raise
        stream.close()
        with self._lock:
            self.records[path.name] = stream.record()

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)
        with self._lock:
            if (record := self.records.pop(Path(path).name, None)) is not None:
                self.records[Path(new_path).name] = record


class HashingWriter(FileSystemWriter):
    """DCP's file writer on a ``HashingFileSystem``."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.hashing_fs = HashingFileSystem()
        self.fs = self.hashing_fs

    @property
    def records(self) -> dict[str, dict]:
        """The manifest entries of the files written so far, by name."""
        return self.hashing_fs.records


def save_state(state: dict, path: Path) -> dict[str, dict]:
    """Write ``state`` to ``path`` (collective under a process group); returns the manifest
    entries of the files this rank wrote. Raises CheckpointException or OSError."""
    writer = HashingWriter(path)
    with _group() as group:
        dcp.save(state, storage_writer=writer, process_group=group)
    return writer.records


class AsyncWrite:
    """A DCP write in flight; ``result`` waits for it and returns this rank's file entries
    (raises CheckpointException or OSError as ``save_state`` does)."""

    def __init__(
        self, state: dict, path: Path, group: dist.ProcessGroup, stager: HostStager
    ) -> None:
        self.writer = HashingWriter(path)
        upload = dcp.async_save(
            state, storage_writer=self.writer, process_group=group, async_stager=stager
        )
        # A stager that copies synchronously (``HostStager``) gets DCP's plain Future back;
        # a staging Future would come with the upload's inside an AsyncSaveResponse.
        self.upload = upload if isinstance(upload, Future) else upload.upload_completion

    def result(self) -> dict[str, dict]:
        self.upload.result()
        return self.writer.records


class HostStager(AsyncStager):
    """Copies a state into host memory before an asynchronous write (synchronously: the only
    part of the save the step waits for). Every tensor gets a buffer of its own, allocated
    at the first save and reused (pinned on a GPU, for fast copies); a DTensor's local piece
    likewise, wrapped again on ``mesh``, a CPU mesh of the DTensor's mesh's shape (DCP plans
    from a DTensor's shape and placements only). DCP's own ``DefaultStager`` copies a
    DTensor made from a view at an offset as if it were a plain tensor, and fails."""

    _synchronize_after_execute = False

    def __init__(self, mesh: DeviceMesh | None, pinned: bool) -> None:
        self.mesh, self.pinned = mesh, pinned
        self._buffers: dict[tuple, torch.Tensor] = {}

    def stage(self, state_dict: dict) -> dict:
        return self._stage_dict(state_dict, ())

    def _stage_dict(self, state: dict, path: tuple) -> dict:
        return {key: self._stage(inner, (*path, key)) for key, inner in state.items()}

    def _stage(self, value: object, path: tuple) -> object:
        if isinstance(value, dict):
            return self._stage_dict(value, path)
        if isinstance(value, DTensor):
            host = self._copy(path, value.to_local())
            return DTensor.from_local(
                host,
                self.mesh,
                value.placements,
                run_check=False,
                shape=value.shape,
                stride=value.stride(),
            )
        return self._copy(path, value) if torch.is_tensor(value) else value

    def _copy(self, path: tuple, tensor: torch.Tensor) -> torch.Tensor:
        buffer = self._buffers.get(path)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=self.pinned)
            self._buffers[path] = buffer
        return buffer.copy_(tensor)

    def synchronize_staging(self) -> None:
        """Nothing to wait for: ``stage`` copies synchronously."""

    def close(self) -> None:
        self._buffers.clear()


def save_state_async(
    state: dict, path: Path, group: dist.ProcessGroup, stager: HostStager
) -> AsyncWrite:
    """Copy ``state`` into ``stager``'s host buffers, then write it to ``path`` in the
    background (collective over ``group``, a gloo group no other thread uses)."""
    return AsyncWrite(state, path, group, stager)


def load_state(state: dict, path: Path) -> None:
    """Fill ``state`` from ``path``, collective under a process group. Raises
    UnsafeCheckpoint (before DCP starts) for metadata that is not DCP's."""
    reader = SafeReader(path)
    with _group() as group:
        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), process_group=group)


def load_alone(state: dict, path: Path) -> None:
    """Fill ``state`` from ``path`` in this process only, whatever the other ranks do."""
    reader = SafeReader(path)
    with _group(alone=True) as group:
        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), process_group=group)


@contextlib.contextmanager
def _group(alone: bool = False) -> Iterator[dist.ProcessGroup | None]:
    """The process group a DCP call runs in: the job's (None), or a one-rank group of this
    process (see the module docstring), destroyed afterwards."""
    if dist.is_initialized() and not alone:
        yield None
    elif dist.is_initialized():
        rank = dist.get_rank()
        group = dist.new_group([rank], backend=host_backend(), use_local_synchronization=True)
        try:
            yield group
        finally:
            dist.destroy_process_group(group)
    else:
        hook = sys.excepthook  # torch wraps it to prefix "[rank0]: ", once per group made
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            yield None
        finally:
            dist.destroy_process_group()
            sys.excepthook = hook


def failure_message(error: BaseException) -> str:
    """One line for a failed DCP call: the first rank's underlying error, not DCP's dump."""
    if isinstance(error, CheckpointException):
        failures = getattr(error, "failures", {}) or {}
        for rank, failure in sorted(failures.items()):
            cause = failure[0] if isinstance(failure, tuple) else failure
            where = f"rank {rank}: " if len(failures) > 1 or rank != 0 else ""
            return where + _first_line(cause)
    return _first_line(error)


def _first_line(error: BaseException) -> str:
    if isinstance(error, UnsafeCheckpoint):
        return f"it holds {error}, which could run code when loaded"
    text = str(error).strip()
    first = text.splitlines()[0] if text else type(error).__name__
    return first[:300]


DCP_ERRORS = (Exception, CheckpointException)  # everything a DCP call raises
