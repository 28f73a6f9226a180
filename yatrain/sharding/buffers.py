"""The engine's preallocated flat buffers and what each currently holds."""

from __future__ import annotations

import torch

from yatrain.sharding.comm import Handle
from yatrain.sharding.layout import alias


class Buffer:
    """A preallocated flat buffer and the unit whose data it holds (or is receiving)."""

    def __init__(self, data: torch.Tensor, owner: int | None = None, fixed: bool = False):
        self.data = data
        self.alias = alias(data)
        self.owner = owner
        self.fixed = fixed  # world size 1: the buffer *is* the unit's shard, always valid
        self.handle: Handle | None = None


class GradSlot:
    """A gradient buffer, the shard-sized reduce-scatter output, and the last RS using them."""

    def __init__(self, data: torch.Tensor, out: torch.Tensor, staging: torch.Tensor | None):
        self.data = data
        self.alias = alias(data)
        self.out = out
        self.staging = staging
        self.handle: Handle | None = None
