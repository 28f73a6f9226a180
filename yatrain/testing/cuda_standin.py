"""Run the engine's CUDA path on the CPU: ``torch.cuda``'s streams and events replaced by the
fakes of ``streams.py``, the engine's communicators made the CUDA kind.

Tests use it to check that every cross-stream access is ordered by an event
(``tests/unit/test_cuda_stream_order.py``); the host-cost benchmark (``bench.host_cost``)
uses the same counts to report the events recorded and the stream waits per step, which on a
GPU are host work.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
import torch.distributed as dist

from yatrain.sharding.groups import make_communicator
from yatrain.testing.streams import FakeEvent, StreamOrder


class Patcher(Protocol):
    """What ``install`` needs to replace an attribute and put it back later (pytest's
    ``MonkeyPatch`` is one; ``patching`` gives another)."""

    def setattr(self, target: Any, name: str, value: Any) -> None: ...


class _Undo:
    def __init__(self) -> None:
        self.saved: list[tuple[Any, str, Any]] = []

    def setattr(self, target: Any, name: str, value: Any) -> None:
        self.saved.append((target, name, getattr(target, name)))
        setattr(target, name, value)


@contextlib.contextmanager
def patching() -> Iterator[Patcher]:
    """A ``Patcher`` whose replacements are undone, last first, when the block ends."""
    undo = _Undo()
    try:
        yield undo
    finally:
        for target, name, value in reversed(undo.saved):
            setattr(target, name, value)


def _collective(order: StreamOrder, run: Callable, name: str, *, reads: bool) -> Callable:
    """A collective on the current stream: it writes its first tensor argument and
    (``reads``) reads its second. What gloo does inside it (copies into temporaries of its
    own) is not recorded: NCCL does not do it on the engine's streams."""

    @functools.wraps(run)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        order.in_collective = True
        try:
            result = run(*args, **kwargs)
        finally:
            order.in_collective = False
        order.op(name, args[1:2] if reads else (), args[:1])
        order.counts[f"{name} on {order.current.name}"] += 1
        return result

    return wrapper


# The collectives the engine calls (comm.py takes whichever name this torch has).
_COLLECTIVES = (
    ("all_gather_single", True),
    ("all_gather_into_tensor", True),
    ("reduce_scatter_single", True),
    ("reduce_scatter_tensor", True),
    ("all_reduce", False),
    ("all_to_all_single", True),
)


def install(patch: Patcher) -> StreamOrder:
    """Patch ``torch.cuda``'s streams and events and the collectives the engine calls;
    returns the ``StreamOrder`` they report to. Record ops with ``order.recording()``."""
    order = StreamOrder()
    cuda = torch.cuda
    patch.setattr(cuda, "Stream", lambda device=None, priority=0: order.new_stream())
    patch.setattr(cuda, "Event", lambda enable_timing=False, **options: FakeEvent(order))
    patch.setattr(cuda, "current_stream", lambda device=None: order.current)
    patch.setattr(cuda, "default_stream", lambda device=None: order.compute)
    patch.setattr(cuda, "stream", order.on)
    patch.setattr(cuda, "synchronize", lambda device=None: order.synchronize())
    first = "all_gather_single" if hasattr(dist, "all_gather_single") else ""
    for name, reads in _COLLECTIVES:
        run = getattr(dist, name, None)
        # torch 2.13 keeps the old names as aliases of the new: wrap one of each only.
        if run is None or (first and name in ("all_gather_into_tensor", "reduce_scatter_tensor")):
            continue
        patch.setattr(dist, name, _collective(order, run, name, reads=reads))
    return order


def _cuda_communicator(group: Any, device: torch.device, **options: Any) -> Any:
    """The engine's communicator choice, made for a CUDA device."""
    return make_communicator(group, torch.device("cuda"), **options)


def as_if_cuda(patch: Patcher) -> StreamOrder:
    """``install``, and every yatrain module that picks a communicator picks the CUDA one:
    an engine built afterwards on the CPU runs its CUDA path on the fake streams."""
    modules = [m for name, m in sys.modules.items() if name.startswith("yatrain.")]
    for module in modules:
        if module is sys.modules[__name__]:
            continue  # its own name stays the real one, which the replacement calls
        if getattr(module, "make_communicator", None) is make_communicator:
            patch.setattr(module, "make_communicator", _cuda_communicator)
    return install(patch)
