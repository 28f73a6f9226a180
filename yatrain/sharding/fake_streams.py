"""Streams and events that do nothing, so the engine's CUDA path runs on a CPU.

A dry run (fake ranks, fake CPU tensors: ``yatrain plan --dry-run``) measures what a GPU rank
holds, and a GPU rank runs the CUDA path: collectives on a communication stream, a stream
reducer that lets go of a gradient once its event reports done. Fake *cuda* tensors cannot
stand in (a CPU-only torch aborts once autograd touches them), so the dry run keeps CPU
tensors and gives ``cuda_comm.CudaStreamCommunicator`` these streams instead of
``torch.cuda``'s (``groups.make_communicator(..., cuda_path=True)``): no module is patched.

Every op already ran when it was issued, so every event reports done (``query()`` is True)
and waiting or synchronising is a no-op: a gradient is let go as early as on a GPU whose
collectives keep up, which is what the memory planner assumes. (The ordering checker of the
tests, ``yatrain/testing/streams.py``, takes the opposite view: the device lags forever.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class FakeEvent:
    """``torch.cuda.Event`` whose work is always done."""

    def __init__(self, enable_timing: bool = False, **options: object) -> None:
        self.recorded = False

    def record(self, stream: object = None) -> None:
        self.recorded = True

    def wait(self, stream: object = None) -> None:
        """Nothing to wait for."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        """Nothing to wait for."""

    def elapsed_time(self, end: FakeEvent) -> float:
        return 0.0


class FakeStream:
    """``torch.cuda.Stream`` whose work is always done."""

    def __init__(self, device: torch.device | str | None = None, priority: int = 0) -> None:
        self.device = device

    def wait_event(self, event: object) -> None:
        """Nothing to wait for."""

    def wait_stream(self, other: object) -> None:
        """Nothing to wait for."""

    def record_event(self, event: FakeEvent | None = None) -> FakeEvent:
        event = event or FakeEvent()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        """Nothing to wait for."""


class FakeStreams:
    """What ``CudaStreamCommunicator`` asks of ``torch.cuda``: ``Stream``, ``Event``,
    ``current_stream`` and the ``stream`` context, on fakes."""

    def __init__(self) -> None:
        self.compute = FakeStream()
        self.current = self.compute

    def Stream(self, device: torch.device | str | None = None, priority: int = 0) -> FakeStream:  # noqa: N802
        return FakeStream(device, priority)

    def Event(self, enable_timing: bool = False, **options: object) -> FakeEvent:  # noqa: N802
        return FakeEvent(enable_timing)

    def current_stream(self, device: torch.device | str | None = None) -> FakeStream:
        return self.current

    @contextlib.contextmanager
    def stream(self, stream: FakeStream | None) -> Iterator[None]:
        """``torch.cuda.stream``: ``stream`` is current inside the block."""
        previous, self.current = self.current, stream or self.current
        try:
            yield
        finally:
            self.current = previous

    def synchronize(self, device: torch.device | str | None = None) -> None:
        """Nothing to wait for."""
