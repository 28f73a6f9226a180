"""Count the places where the host waits for the device: the check that a training step
never does (``runtime.host_reads``).

``HostSyncCounter`` is a dispatch mode that counts, while it is entered:
- reads of a tensor's value: ``aten._local_scalar_dense`` (``.item()``, ``bool()``,
  ``float()``) and ``Tensor.tolist()`` (which no dispatch mode sees: it is wrapped);
- copies from a device to the host (``_to_copy`` / ``copy_`` into a CPU tensor);
- stream, event and device synchronisations: ``torch.cuda``'s, and those of the CUDA
  path's stand-in (``testing.streams``), which is what a CPU run of that path calls.

Tensors marked host-side by design (``host_reads.on_host``: the guard's stop flags) are
not counted: reading them waits for no device, even on a CPU run. Ops on other threads are
not seen (dispatch modes are per thread): the step's reads happen on the loop's thread.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from yatrain.runtime.host_reads import is_host_side
from yatrain.testing import streams

_aten = torch.ops.aten
_COPIES = (_aten._to_copy.default, _aten.copy_.default)


def _to_host(func: Any, args: tuple, kwargs: dict) -> bool:
    if func is _aten._to_copy.default:
        target = kwargs.get("device")
        return target is not None and torch.device(target).type == "cpu" and args[0].is_cuda
    destination, source = args[0], args[1]
    return destination.device.type == "cpu" and source.device.type != "cpu"


class HostSyncCounter(TorchDispatchMode):
    """``counts``: host waits by kind while entered (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self._undo: list[tuple[Any, str, Any]] = []

    def total(self) -> int:
        return sum(self.counts.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _aten._local_scalar_dense.default and not is_host_side(args[0]):
            self.counts["item"] += 1
        elif func in _COPIES and _to_host(func, args, kwargs):
            self.counts["device-to-host copy"] += 1
        return func(*args, **kwargs)

    def __enter__(self) -> HostSyncCounter:
        def tolist(tensor: torch.Tensor, *args: Any, _real=torch.Tensor.tolist) -> Any:
            if not is_host_side(tensor):
                self.counts["tolist"] += 1
            return _real(tensor, *args)

        self._patch(torch.Tensor, "tolist", tolist)
        for owner, name in [
            (torch.cuda, "synchronize"),
            (torch.cuda.Event, "synchronize"),
            (torch.cuda.Stream, "synchronize"),
            (streams.FakeEvent, "synchronize"),
            (streams.FakeStream, "synchronize"),
            (streams.StreamOrder, "synchronize"),
        ]:
            if callable(getattr(owner, name, None)):  # the stand-in's Event is a function
                self._patch(owner, name, self._counting(getattr(owner, name), name))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        for owner, name, value in reversed(self._undo):
            setattr(owner, name, value)
        self._undo.clear()

    def _patch(self, owner: Any, name: str, value: Any) -> None:
        self._undo.append((owner, name, owner.__dict__.get(name, getattr(owner, name))))
        setattr(owner, name, value)

    def _counting(self, real: Callable, kind: str) -> Callable:
        @functools.wraps(real)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self.counts[kind] += 1
            return real(*args, **kwargs)

        return wrapper
