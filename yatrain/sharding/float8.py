"""Float8 weight gathers: half the bytes of a bf16 gather for the units that compute in fp8.

A unit whose every weight the caller's ``Float8Format`` says gathers in float8 (torchao's
``Float8Linear`` with tensorwise scaling, told by ``models/float8.py``) is gathered as
bytes: before the gather each rank casts its fp32 master shard into its own slice of the
gather buffer, one scale per weight tensor, and the all-gather moves ``uint8`` (gloo has no
float8 type; the bytes are the same). The weights bound to the modules are then float8
tensors over the gather buffer with their scales, which the matmul consumes as they are: no
second cast, and the backward reads the same bytes.

A tensorwise scale needs each tensor's global amax, and a shard holds pieces of several
tensors: every rank takes the amax of its pieces, and one all-reduce (MAX) of all of them
per step, before the step's first fp8 gather, gives every rank the same scales. The masters
change only in the optimizer step, so ``after_step`` marks the scales stale. The cast is the
one torchao makes of the whole fp32 tensor, so a gathered weight equals bit for bit what one
process casts (tests/integration/test_float8.py).

Gradients, their reduction, the masters and the optimizer are untouched: checkpoints are
the same with and without float8. Single-process runs without a group compute from the
shard itself and leave the cast to the module.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from yatrain.sharding.layout import FlatLayout


@dataclass(frozen=True)
class Float8Format:
    """What the engine needs to gather some weights in float8 (the caller knows the
    modules; the engine knows only this)."""

    dtype: torch.dtype  # the float8 type of the gathered weights
    gathers_in_fp8: Callable[[nn.Module, str], bool]  # this parameter gathers in float8
    scale_of: Callable[[torch.Tensor], torch.Tensor]  # fp32 amaxes -> fp32 scales
    # (float8 data, scale, module, the run's dtype) -> the weight the module computes with
    bind: Callable[[torch.Tensor, torch.Tensor, nn.Module, torch.dtype], torch.Tensor]


@dataclass(frozen=True)
class _Piece:
    """The part of one weight tensor inside this rank's shard."""

    scale: int  # index into the scales
    start: int  # in the shard
    length: int


class Float8Gathers:
    """Which units gather in float8, their scales, the cast into a shard and the binding."""

    def __init__(
        self,
        fmt: Float8Format,
        layouts: Sequence[FlatLayout],
        rank: int,
        device: torch.device,
    ) -> None:
        self.fmt, self.rank = fmt, rank
        self.first_scale: dict[int, int] = {}  # unit -> index of its first tensor's scale
        self.pieces: dict[int, list[_Piece]] = {}
        count = 0
        for unit, layout in enumerate(layouts):
            eligible = all(fmt.gathers_in_fp8(s.module, s.attr) for s in layout.slots)
            if not (layout.owns and eligible):
                continue
            self.first_scale[unit] = count
            begin, end = layout.shard_range(rank)
            self.pieces[unit] = []
            for k, slot in enumerate(layout.slots):
                lo, hi = max(begin, slot.offset), min(end, slot.offset + slot.numel)
                if lo < hi:
                    self.pieces[unit].append(_Piece(count + k, lo - begin, hi - lo))
            count += len(layout.slots)
        self.scales = torch.ones(count, dtype=torch.float32, device=device)
        self.fresh = False  # the scales match the masters

    def gathers(self, unit: int) -> bool:
        return unit in self.first_scale

    @property
    def units(self) -> list[int]:
        return list(self.first_scale)

    @torch.no_grad()
    def refresh(
        self, masters: Sequence[torch.Tensor], all_reduce_max: Callable[[torch.Tensor], int]
    ) -> None:
        """Every scale from the global amax of its tensor: one collective for all of them."""
        amax = torch.zeros_like(self.scales)
        for unit, pieces in self.pieces.items():
            shard = masters[unit]
            for piece in pieces:
                part = shard.narrow(0, piece.start, piece.length)
                amax[piece.scale] = part.abs().amax().float()
        all_reduce_max(amax)
        self.scales.copy_(self.fmt.scale_of(amax))
        self.fresh = True

    @torch.no_grad()
    def cast(self, unit: int, shard: torch.Tensor, out: torch.Tensor) -> None:
        """This rank's fp32 ``shard`` of ``unit`` into ``out`` (bytes), each tensor's piece
        with its scale; the padding becomes zeros."""
        fp8 = out.view(self.fmt.dtype)
        limit = torch.finfo(self.fmt.dtype).max
        covered = 0
        for piece in self.pieces[unit]:
            part = shard.narrow(0, piece.start, piece.length).float() * self.scales[piece.scale]
            fp8.narrow(0, piece.start, piece.length).copy_(part.clamp(-limit, limit))
            covered = max(covered, piece.start + piece.length)
        out[covered:].zero_()

    def weights(
        self, unit: int, layout: FlatLayout, flat: torch.Tensor, dtype: torch.dtype
    ) -> list[torch.Tensor]:
        """The float8 weights of ``unit`` over its gathered bytes ``flat``."""
        first = self.first_scale[unit]
        data = flat.view(self.fmt.dtype)
        return [
            self.fmt.bind(
                data.narrow(0, slot.offset, slot.numel).view(slot.shape),
                self.scales[first + k],
                slot.module,
                dtype,
            )
            for k, slot in enumerate(layout.slots)
        ]
