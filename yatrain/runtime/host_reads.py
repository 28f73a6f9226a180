"""The one door through which the training loop reads device values.

Reading a device value (``.item()``, ``.tolist()``, ``bool()``, a copy to the host) makes
the host wait until every kernel queued before it has run: the host can then queue no more
of the next step's work, and the device idles. The loop reads only where a reader needs a
number: at log steps (the metrics, the clock, peak memory), evaluations and saves (the
guard's checks first). Every such read goes through ``host_read``, so the rule is visible
in one place (``testing.host_syncs`` counts what escapes it).

Under a dry run's fake tensors (``yatrain plan --dry-run``) a device value does not exist:
the door answers None ("unknown", printed ``n/a``) instead, so the loop needs no dry-run
branch of its own.

Tensors that live on the host by design (the guard's stop flags, all-reduced on a CPU
process group) are marked with ``on_host``: reading them waits for no device.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TypeVar

import torch

# FakeTensorMode's refusal to read a value it does not have: an allowed private import
# (the house rules' exception for dry runs).
from torch._subclasses.fake_tensor import DataDependentOutputException

T = TypeVar("T")

_HOST_SIDE: dict[int, weakref.ref] = {}  # by identity (a tensor's == is elementwise)


def host_read(read: Callable[[], T]) -> T | None:
    """Run ``read``, which reads device values: the loop's only way to do so. None where
    the values do not exist (fake tensors: a dry run)."""
    try:
        return read()
    except DataDependentOutputException:
        return None


def device_values(*tensors: torch.Tensor) -> list[float | None]:
    """Several device scalars as floats, in one copy to the host (through ``host_read``);
    each None where unknown (a dry run)."""
    values = host_read(
        lambda: torch.stack([t.detach().to(torch.float64).reshape(()) for t in tensors]).tolist()
    )
    return [None] * len(tensors) if values is None else values


def on_host(tensor: torch.Tensor) -> torch.Tensor:
    """Mark ``tensor`` as host-side by design (a CPU tensor of host flags): reading it is no
    device synchronisation, even on a CPU run where the device is the host."""
    key = id(tensor)
    _HOST_SIDE[key] = weakref.ref(tensor, lambda _: _HOST_SIDE.pop(key, None))
    return tensor


def is_host_side(tensor: torch.Tensor) -> bool:
    ref = _HOST_SIDE.get(id(tensor))
    return ref is not None and ref() is tensor
