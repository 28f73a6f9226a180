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

Categories, for saying *what* the peak is made of (a dry run's table beside the planner's
terms): each storage counts under the tracker's ``category`` when it is first seen (the
caller sets it, e.g. to the module running), or under the one ``adopt`` names; ``classify``
moves a live storage to another once the caller knows it by identity (a gradient shard,
known only after the code that allocated it stored it). ``by_category`` holds the live
bytes of each, ``peak_by_category`` a copy of them at the peak: one dict lookup per new
storage, one small dict copy each time the peak rises. Each storage carries the count of
storages seen before it, so a move also corrects the peak's copy when that storage was
already live at the peak. ``where``, if given, is asked at each new peak where the
caller's code stands (``peak_where``: its answer at the peak).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

UNSORTED = "unsorted"  # the category of a storage nobody named one for


def _storages(tree) -> list[tuple[torch.UntypedStorage, torch.device]]:
    """Each storage in ``tree`` with the device it counts on (its tensor's: see above)."""
    found = []
    for leaf in pytree.tree_leaves(tree):
        if isinstance(leaf, torch.Tensor):
            found.append((leaf.untyped_storage(), leaf.device))
        elif isinstance(leaf, torch.UntypedStorage):
            found.append((leaf, leaf.device))
    return found


def _move(totals: dict[str, int], old: str, new: str, nbytes: int) -> None:
    totals[old] = totals.get(old, 0) - nbytes
    totals[new] = totals.get(new, 0) + nbytes


class LiveTensorTracker(TorchDispatchMode):
    """Context manager: ``current``, ``peak`` and ``reset_peak()`` over live storages.

    >>> with LiveTensorTracker() as mem:
    ...     loss = model(x).sum(); before = mem.current; mem.reset_peak()
    ...     loss.backward()
    >>> activation_peak = mem.peak - before
    """

    def __init__(
        self,
        device: torch.device | str | None = None,
        category: str = UNSORTED,
        where: Callable[[], object] | None = None,
    ) -> None:
        super().__init__()
        self.device_type = None if device is None else torch.device(device).type
        self.current = 0
        self.peak = 0
        self.category = category  # what a storage seen from now on counts as
        self.by_category: dict[str, int] = {}  # live bytes per category
        self.peak_by_category: dict[str, int] = {}  # ``by_category`` at the peak
        self.where = where  # asked at each new peak where the caller's code stands
        self.peak_where: object = None  # its answer at the peak
        self._live: dict[int, tuple[int, str, int]] = {}  # id(storage) -> bytes, category, seen
        self._refs: dict[int, weakref.finalize] = {}
        self._seen = 0  # storages counted so far: the next one's sequence number - 1
        self._peak_seen = 0  # ``_seen`` when the peak was reached

    # ------------------------------------------------------------------ bookkeeping
    def _add(self, storage: torch.UntypedStorage, device: torch.device, category: str) -> None:
        if device.type == "meta":
            return
        if self.device_type is not None and device.type != self.device_type:
            return
        key = id(storage)  # unique while it lives; ``_drop`` forgets it when it dies
        nbytes = storage.nbytes()
        if key in self._live or nbytes == 0:
            return
        self._seen += 1
        self._live[key] = (nbytes, category, self._seen)
        self._refs[key] = weakref.finalize(storage, self._drop, key)
        self.by_category[category] = self.by_category.get(category, 0) + nbytes
        self.current += nbytes
        if self.current > self.peak:
            self._mark_peak()

    def _mark_peak(self) -> None:
        self.peak, self._peak_seen = self.current, self._seen
        self.peak_by_category = dict(self.by_category)
        if self.where is not None:
            self.peak_where = self.where()

    def _drop(self, key: int) -> None:
        nbytes, category, _ = self._live.pop(key, (0, UNSORTED, 0))
        self._refs.pop(key, None)
        self.current -= nbytes
        if nbytes:
            self.by_category[category] -= nbytes

    def adopt(self, tensors: Iterable[torch.Tensor], category: str | None = None) -> None:
        """Count tensors that existed before the context opened (e.g. a model's weights),
        under ``category`` (default: the tracker's); a storage already counted keeps its."""
        for tensor in tensors:
            self._add(tensor.untyped_storage(), tensor.device, category or self.category)

    def classify(self, tensors: Iterable[torch.Tensor], category: str) -> None:
        """Count these tensors' live storages under ``category`` from now on, and in
        ``peak_by_category`` too where they were live at the peak (see the module
        docstring); storages not counted are left alone."""
        for tensor in tensors:
            key = id(tensor.untyped_storage())
            entry = self._live.get(key)
            if entry is None or entry[1] == category:
                continue
            nbytes, old, seen = entry
            self._live[key] = (nbytes, category, seen)
            _move(self.by_category, old, category, nbytes)
            if seen <= self._peak_seen:  # live then (a storage never comes back)
                _move(self.peak_by_category, old, category, nbytes)

    def reset_peak(self) -> None:
        """Start a new measurement window: peak = what is live now."""
        self._mark_peak()

    # ------------------------------------------------------------------ dispatch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {id(storage) for storage, _ in _storages((args, kwargs))}
        for storage, device in _storages(out):
            if id(storage) not in inputs:
                self._add(storage, device, self.category)
        return out

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        for ref in list(self._refs.values()):
            ref.detach()  # stop callbacks into a tracker nobody reads any more
        self._refs.clear()
