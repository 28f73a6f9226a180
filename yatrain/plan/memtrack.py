"""Peak bytes of live tensor storages, on any device (the CPU has no allocator statistics).

The memory planner is only as good as its model of what a training step keeps alive; this
tracker is how the tests check it. Inside the context every aten op on the calling thread is
seen (forward, backward and optimizer ops alike, because the autograd engine runs CPU work on
the thread that calls ``backward()``). Each storage an op returns that is not already known
and does not alias one of the op's inputs is counted from then on; a weak reference drops it
again when the storage dies. ``peak`` is the largest total seen since the last
``reset_peak()``.

What it does not see: storages allocated before the context opened (unless ``adopt``-ed),
scratch memory inside a kernel, and buffers a communication library allocates on its own
threads. Storages are counted by their byte size, not by the allocator's rounded block size.

A storage is known by identity (torch keeps one Python object per storage for as long as the
storage lives), not by its address: a fake tensor (``FakeTensorMode``, a dry run) has none,
and its storage is a meta one; it counts on the device its tensor reports. Tensors on the
meta device itself hold no memory and are not counted.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode


def _storages(tree) -> list[tuple[torch.UntypedStorage, torch.device]]:
    """Each storage in ``tree`` with the device it counts on (its tensor's: see above)."""
    found = []
    for leaf in pytree.tree_leaves(tree):
        if isinstance(leaf, torch.Tensor):
            found.append((leaf.untyped_storage(), leaf.device))
        elif isinstance(leaf, torch.UntypedStorage):
            found.append((leaf, leaf.device))
    return found


class LiveTensorTracker(TorchDispatchMode):
    """Context manager: ``current``, ``peak`` and ``reset_peak()`` over live storages.

    >>> with LiveTensorTracker() as mem:
    ...     loss = model(x).sum(); before = mem.current; mem.reset_peak()
    ...     loss.backward()
    >>> activation_peak = mem.peak - before
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.device_type = None if device is None else torch.device(device).type
        self.current = 0
        self.peak = 0
        self._live: dict[int, int] = {}  # id(storage) -> bytes counted
        self._refs: dict[int, weakref.finalize] = {}

    # ------------------------------------------------------------------ bookkeeping
    def _add(self, storage: torch.UntypedStorage, device: torch.device) -> None:
        if device.type == "meta":
            return
        if self.device_type is not None and device.type != self.device_type:
            return
        key = id(storage)  # unique while it lives; ``_drop`` forgets it when it dies
        nbytes = storage.nbytes()
        if key in self._live or nbytes == 0:
            return
        self._live[key] = nbytes
        self._refs[key] = weakref.finalize(storage, self._drop, key)
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def _drop(self, key: int) -> None:
        nbytes = self._live.pop(key, 0)
        self._refs.pop(key, None)
        self.current -= nbytes

    def adopt(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count tensors that existed before the context opened (e.g. a model's weights)."""
        for tensor in tensors:
            self._add(tensor.untyped_storage(), tensor.device)

    def reset_peak(self) -> None:
        """Start a new measurement window: peak = what is live now."""
        self.peak = self.current

    # ------------------------------------------------------------------ dispatch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {id(storage) for storage, _ in _storages((args, kwargs))}
        for storage, device in _storages(out):
            if id(storage) not in inputs:
                self._add(storage, device)
        return out

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        for ref in list(self._refs.values()):
            ref.detach()  # stop callbacks into a tracker nobody reads any more
        self._refs.clear()
