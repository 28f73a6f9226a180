"""How many buffers the engine preallocates, of which sizes and dtypes: one pure function.

The engine allocates exactly what ``engine_buffers`` returns and the memory planner calls the
same function over meta-device layouts, so the two cannot drift apart. Inputs are what the
engine knows before it allocates anything: each unit's element count, whether its gradient
arrives as a single tensor, the norm group's size, world size, dtypes and prefetch depth.

The rules, and why:

- Gather buffers rotate: ``prefetch_depth + 1`` of them, consecutive units taking turns. The
  edge units (first and last, e.g. embedding and output head) either join the rotation, so
  every buffer is sized by the largest unit, or own one extra buffer, so the rotation is
  sized by the largest inner unit. Whichever costs fewer bytes is chosen: with a vocabulary
  much larger than a layer (Llama 3 8B) the extra buffer is cheaper; when edge and layer
  are close (Llama 3 70B) rotating is.
- In bf16 each gather first casts this rank's fp32 shard into its own slice of the gather
  buffer and then all-gathers in place: no bf16 copy of the shard is kept, and no input
  buffer is needed.
- Gradient buffers: two, taking turns, sized by the largest unit with several weight
  tensors. A unit with a single weight tensor (an embedding, an output head) produces its
  gradient as one fresh tensor anyway (autograd allocates it), so the engine reduces that
  tensor directly and needs no buffer for it.
- A unit gathered in float8 (``float8.py``) needs one byte per element: its gather size
  counts in the run dtype's elements, so a rotation of float8 layers is half a bf16 one.
- Reduce-scatter staging: a unit's gradient is cast into a staging buffer in the reduce
  dtype and reduce-scattered from it, once per unit and micro-batch wherever the unit fits
  the staging budget (``staging_budget``: ``sharding.reduce_staging_mib``, or ``auto`` =
  max(256 MiB, 1% of the device's memory)); a unit larger than the budget goes in the fewest
  equal pieces that fit (``equal_pieces``). Host work then grows with the units, not the
  parameters: each piece is a cast copy, a collective and, on CUDA, nothing else (the events
  are per unit, ``reduce.py``). The result lands in the fp32 gradient shard (straight into
  it on the first micro-batch, through a piece-sized output buffer and an add on later
  ones).
- World size 1 without a process group (``direct``): parameters are views of the shard
  (or of its bf16 copy), so there are no gather buffers, and each gradient is copied (cast)
  into the fp32 gradient shard as it arrives: no gradient buffers either. The norm group's
  gradient accumulates in its own buffer when it is bf16.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

MIB = 2**20
STAGING_FLOOR_BYTES = 256 * MIB  # ``auto`` staging: at least this much ...
STAGING_DEVICE_SHARE = 0.01  # ... or this share of the device's memory, whichever is larger


def staging_budget(setting_mib: float | str | None, device_memory_bytes: int | None) -> int:
    """Bytes the reduce-scatter staging may take (``sharding.reduce_staging_mib``): the
    setting, or for ``auto`` (``None``) max(256 MiB, 1% of the device's memory). One rule
    on every device, so the planner and the engine agree."""
    if setting_mib is not None and setting_mib != "auto":
        return max(1, int(float(setting_mib) * MIB))
    share = int(STAGING_DEVICE_SHARE * device_memory_bytes) if device_memory_bytes else 0
    return max(STAGING_FLOOR_BYTES, share)


def device_memory(device: torch.device) -> int | None:
    """The memory ``auto`` staging is a share of: a GPU's total memory, a CPU's RAM."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX system
        return None


def equal_pieces(shard_numel: int, max_width: int) -> tuple[int, int]:
    """(count, width): the fewest equal pieces of at most ``max_width`` columns that cover
    a shard of ``shard_numel`` elements (the last one may be shorter)."""
    count = max(1, -(-shard_numel // max(1, max_width)))
    return count, -(-shard_numel // count)


def padded(numel: int, world_size: int) -> int:
    """A unit's flat length rounded up to a multiple of the world size."""
    return math.ceil(numel / world_size) * world_size


@dataclass(frozen=True)
class BufferSpec:
    """``count`` buffers of ``numel`` elements of ``dtype`` each."""

    count: int
    numel: int
    dtype: torch.dtype

    @property
    def bytes(self) -> int:
        return self.count * self.numel * self.dtype.itemsize

    def empty(self, device: torch.device) -> torch.Tensor:
        """One of these buffers, uninitialised (the engine writes before it reads)."""
        return torch.empty(self.numel, dtype=self.dtype, device=device)


@dataclass(frozen=True)
class EngineBuffers:
    """Every buffer the engine preallocates on one rank."""

    gather: BufferSpec  # the rotation of unit gather buffers
    edge_gather: BufferSpec  # count 0: the edge units rotate with the others
    grad: BufferSpec  # gradient buffers of units with several weight tensors
    staging: BufferSpec  # reduce-scatter input, one piece of every rank's shard
    reduce_out: BufferSpec  # one piece of this rank's shard, for accumulating micro-batches
    small_gather: BufferSpec  # the norm group, gathered once per step
    small_grad: BufferSpec
    small_out: BufferSpec
    piece_numel: int  # per rank, elements of the widest reduce-scatter piece (0: none)
    pieces: tuple[int, ...] = ()  # reduce-scatter pieces of each unit's gradient

    @property
    def edge_owns_gather(self) -> bool:
        return self.edge_gather.count > 0

    def gather_bytes(self) -> int:
        return self.gather.bytes + self.edge_gather.bytes + self.small_gather.bytes

    def gradient_bytes(self) -> int:
        parts = (self.grad, self.staging, self.reduce_out, self.small_grad, self.small_out)
        return sum(p.bytes for p in parts)

    def total_bytes(self) -> int:
        return self.gather_bytes() + self.gradient_bytes()


def gather_numels(
    padded_numels: Sequence[int], fp8_units: Sequence[bool], dtype: torch.dtype
) -> list[int]:
    """Each unit's gather size in elements of the run's ``dtype``: a unit gathered in
    float8 (``float8.py``) needs one byte per element, in a buffer of the run's dtype."""
    if not fp8_units:
        return list(padded_numels)
    return [
        -(-n // dtype.itemsize) if fp8 else n
        for n, fp8 in zip(padded_numels, fp8_units, strict=True)
    ]


def _none(dtype: torch.dtype) -> BufferSpec:
    return BufferSpec(0, 0, dtype)


def _gather_rotation(
    sizes: list[int], ring: int, dtype: torch.dtype
) -> tuple[BufferSpec, BufferSpec]:
    """All units in one rotation, or the edge units in one buffer of their own: the one
    that costs fewer bytes (ties keep the plain rotation)."""
    edges = sorted({0, len(sizes) - 1})
    inner = [s for i, s in enumerate(sizes) if i not in edges]
    options = [(BufferSpec(ring, max(sizes), dtype), _none(dtype))]
    if inner:
        edge_n = max(sizes[i] for i in edges)
        options.append((BufferSpec(ring, max(inner), dtype), BufferSpec(1, edge_n, dtype)))
    return min(options, key=lambda o: o[0].bytes + o[1].bytes)


def engine_buffers(
    unit_numels: Sequence[int],
    single_tensor: Sequence[bool],
    small_numel: int,
    *,
    world_size: int,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    prefetch_depth: int,
    direct: bool,
    staging_bytes: int = STAGING_FLOOR_BYTES,
    fp8_units: Sequence[bool] = (),
) -> EngineBuffers:
    """The buffers for units of ``unit_numels`` elements (in forward order) on one rank.

    ``single_tensor[i]``: unit i has one weight tensor, so its gradient is reduced from the
    tensor autograd produces. ``direct``: world size 1 without a process group.
    ``fp8_units[i]``: unit i is gathered in float8 (one byte per element).
    ``staging_bytes``: the reduce-scatter staging budget (``staging_budget``)."""
    if len(unit_numels) != len(single_tensor) or not unit_numels:
        raise ValueError("need one single_tensor flag per unit, and at least one unit")
    if prefetch_depth < 1 or world_size < 1 or staging_bytes < 1:
        raise ValueError("prefetch_depth, world_size and staging_bytes must be at least 1")
    if direct and world_size != 1:
        raise ValueError("the direct path exists only at world size 1")
    if direct:
        return _direct_buffers(small_numel, param_dtype, reduce_dtype)
    p, r, w = param_dtype, reduce_dtype, world_size
    sizes = [padded(n, w) for n in unit_numels]
    ring = prefetch_depth + 1

    # Gradient buffers: units with several tensors.
    slot_units = [s for s, single in zip(sizes, single_tensor, strict=True) if not single]
    grad = BufferSpec(min(2, len(slot_units)), max(slot_units, default=0), p)

    gather, edge_gather = _gather_rotation(gather_numels(sizes, fp8_units, p), ring, p)

    # Reduce-scatter pieces: each unit in the fewest equal pieces whose staging (w columns
    # of the piece's width) fits the budget; the staging holds the widest of them.
    budget_width = staging_bytes // (w * r.itemsize)
    pieces = [equal_pieces(size // w, budget_width) for size in sizes]
    piece = max(width for _, width in pieces)
    small = padded(small_numel, w)
    return EngineBuffers(
        gather=gather,
        edge_gather=edge_gather,
        grad=grad,
        staging=BufferSpec(1, w * piece, r),
        reduce_out=BufferSpec(1, piece, r),
        small_gather=BufferSpec(1, small, p),
        small_grad=BufferSpec(1, small, p),
        small_out=_none(r) if r == torch.float32 else BufferSpec(1, small // w, r),
        piece_numel=piece,
        pieces=tuple(count for count, _ in pieces),
    )


def _direct_buffers(small_numel: int, p: torch.dtype, r: torch.dtype) -> EngineBuffers:
    """One process without a group: nothing to gather or reduce, so no buffers but the
    norm group's gradient, accumulated apart from its fp32 shard when it is not fp32."""
    none = _none(p)
    return EngineBuffers(
        gather=none,
        edge_gather=none,
        grad=none,
        staging=_none(r),
        reduce_out=_none(r),
        small_gather=none,
        small_grad=none if p == torch.float32 else BufferSpec(1, small_numel, p),
        small_out=_none(r),
        piece_numel=0,
    )
