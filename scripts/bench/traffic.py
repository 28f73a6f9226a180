"""Bytes each rank sends in collectives, counted the same way for every contender."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist


class CommCounter:
    """Counts the bytes this rank sends in ``torch.distributed`` collectives.

    Wraps the module-level collective functions (the names FSDP2, DDP comm hooks and the
    yatrain engine call through ``torch.distributed``) and applies ring-algorithm
    accounting, the same as ``yatrain.sharding.comm``: an all-gather or reduce-scatter
    sends (W-1)/W of the full (unsharded) buffer, an all-reduce 2(W-1)/W of its buffer.
    This is nominal ring traffic, not what gloo puts on the wire (gloo's reduce-scatter is
    an all-reduce plus a chunk copy). Functional collectives (DTensor internals, e.g. the
    scalar norm inside ``clip_grad_norm_`` on DTensors) bypass these functions and are
    not seen; ``calls`` lists what was seen so a reader can check coverage.
    """

    GATHERS = ("all_gather_single", "all_gather_into_tensor", "_all_gather_base")
    SCATTERS = ("reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base")
    REDUCES = ("all_reduce",)

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.bytes_sent = 0
        self.calls: dict[str, int] = {}
        self._saved: dict[str, Callable] = {}

    def install(self) -> CommCounter:
        for name in (*self.GATHERS, *self.SCATTERS, *self.REDUCES):
            original = getattr(dist, name, None)
            if original is None or name in self._saved:
                continue
            self._saved[name] = original
            setattr(dist, name, self._wrap(name, original))
        return self

    def uninstall(self) -> None:
        for name, original in self._saved.items():
            setattr(dist, name, original)
        self._saved.clear()

    def _wrap(self, name: str, original: Callable) -> Callable:
        counter = self

        def wrapper(*args, **kwargs):
            counter._count(name, args, kwargs)
            return original(*args, **kwargs)

        wrapper.__wrapped__ = original  # type: ignore[attr-defined]
        return wrapper

    def _count(self, name: str, args: tuple, kwargs: dict) -> None:
        group = kwargs.get("group")  # a subgroup's ring is its own size
        w = self.world_size if group is None else dist.get_world_size(group)
        if name in self.GATHERS:  # (output=full, input=shard)
            full = kwargs.get("output_tensor", args[0] if args else None)
            share = (w - 1) / w
        elif name in self.SCATTERS:  # (output=shard, input=full)
            full = kwargs.get("input", args[1] if len(args) > 1 else None)
            share = (w - 1) / w
        else:
            full = kwargs.get("tensor", args[0] if args else None)
            share = 2 * (w - 1) / w
        if torch.is_tensor(full):
            self.bytes_sent += int(full.numel() * full.element_size() * share)
        self.calls[name] = self.calls.get(name, 0) + 1
