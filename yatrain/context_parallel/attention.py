"""Attention over a window's gathered keys and values, for this rank's chunks of it (context
parallelism, ``split``): the ``Attend`` a model gets in place of its causal attention.

Rank i holds chunks i and 2 CP - 1 - i of a window (``sharding.context_parallel``); each
attention layer gathers the window's keys and values (``ContextGroup.gather``: one
all-gather, reduce-scattered in the backward) and attends each local chunk's queries to the
keys up to the chunk's end, causally aligned to the chunk's place in the window: lower right,
where SDPA's ``is_causal`` aligns top left, wrong when queries are fewer than keys. How the
alignment is given to SDPA is a question of memory:

- documents masked: one boolean [B, 1, w, end] mask per chunk (same document, not later),
  made additive once per micro-batch and shared by every layer (SDPA would convert a boolean
  mask in each layer and keep each copy for the backward);
- on CUDA in bf16/fp16: torch's ``causal_lower_right`` bias, which its flash kernel applies
  without a mask;
- elsewhere (CPU, where that bias is materialised as a [w, end] mask per layer): the chunk's
  queries in pieces of at most ``MASK_ELEMENTS / T`` rows, every piece masked by a view of
  one additive [rows, T] mask shared by all pieces, chunks and layers (the lower-right
  pattern of any piece is the last columns of that one mask). 8 MiB of fp32 mask per
  micro-batch whatever the window, instead of w x end per chunk.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from yatrain.context_parallel.group import MASK_ELEMENTS, ContextGroup
from yatrain.models.llama import document_causal_mask

Piece = tuple[int, int, int]  # local query rows [first, last) against window keys [0, stop)


class GatheredAttention:
    """One micro-batch's attention under CP (see the module docstring). ``lower_right``:
    use torch's causal bias (default: on CUDA in half precision); ``mask_elements``: the
    shared mask's budget."""

    def __init__(
        self,
        group: ContextGroup,
        seq_len: int,
        document_ids: torch.Tensor | None,
        *,
        lower_right: bool | None = None,
        mask_elements: int = MASK_ELEMENTS,
    ) -> None:
        self.group, self.seq_len = group, seq_len
        self.documents, self.lower_right = document_ids, lower_right
        self.mask_elements = mask_elements
        self.pieces: list[Piece] = []
        self.masks: list[Any] = []  # each piece's tensor or causal bias, made at the first layer
        self._dtype: torch.dtype | None = None  # of the masks, once made

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [B, heads, 2 w, D], k, v [B, kv heads, 2 w, D] this rank's -> [B, heads, 2 w, D]."""
        keys, values = self.group.gather(torch.stack([k, v]), dim=3).unbind(0)
        if self._dtype != q.dtype:
            self._prepare(q.dtype, q.device)
        outs = [
            F.scaled_dot_product_attention(
                q[:, :, first:last],
                keys[:, :, :stop],
                values[:, :, :stop],
                attn_mask=mask,
                enable_gqa=True,
            )
            for (first, last, stop), mask in zip(self.pieces, self.masks, strict=True)
        ]
        return torch.cat(outs, dim=2)

    def _prepare(self, dtype: torch.dtype, device: torch.device) -> None:
        """The pieces and their masks (see the module docstring)."""
        bias = self.lower_right
        if bias is None:
            bias = device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
        width, window = self.seq_len // (2 * self.group.size), self.seq_len
        whole = self.documents is not None or bias  # one piece per chunk
        rows = width if whole else max(1, min(width, self.mask_elements // window))
        self.pieces = []
        for i, chunk in enumerate(self.group.chunks):
            row, start = i * width, chunk * width
            for first in range(0, width, rows):
                last = min(first + rows, width)
                self.pieces.append((row + first, row + last, start + last))
        shapes = [(last - first, stop) for first, last, stop in self.pieces]
        if self.documents is not None:
            self.masks = [
                additive(document_causal_mask(self.documents, stop - n, stop), dtype)
                for n, stop in shapes
            ]
        elif bias:
            # imports torch._dynamo and inductor: only where a CUDA half-precision run uses it
            from torch.nn.attention.bias import causal_lower_right

            self.masks = [causal_lower_right(n, stop) for n, stop in shapes]
        else:
            causal = torch.ones(rows, window, dtype=torch.bool, device=device)
            shared = additive(causal.tril(window - rows), dtype)
            self.masks = [shared[rows - n :, window - stop :] for n, stop in shapes]
        self._dtype = dtype


def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True: attend) as an additive one in ``dtype``: 0 or -inf."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, -torch.inf)
