"""Failures of the machine, not of the user's input, in one line: a lost peer, no memory.

A rank whose peer died sees a ``DistBackendError`` (NCCL) or a gloo ``RuntimeError``
("Connection reset by peer", "Connection closed by peer", a timed-out receive); an
allocation that cannot be served raises ``torch.OutOfMemoryError`` (CUDA) or a
``RuntimeError`` from the CPU allocator. ``explain`` turns those into the ``TrainingError``
the command line prints as one line, naming where the run was; anything else is left alone
(a bug keeps its traceback).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.distributed as dist

from yatrain.errors import LostPeer, TrainingError

_PEER_SIGNS = (
    "connection reset by peer",
    "connection closed by peer",
    "broken pipe",
    "connection refused",
    "timed out",
    "timeout",
    "socket closed",
    "gloo",
    "nccl",
)
_MEMORY_SIGNS = ("can't allocate memory", "out of memory", "not enough memory")
_SOURCE = re.compile(r"^\[[^\]]*\.(cc|cpp|h):\d+\] ")  # gloo's "[.../pair.cc:537] " prefix


def explain(error: BaseException, where: str, report: Path | None = None) -> TrainingError | None:
    """The one-line error for ``error`` raised ``where`` (e.g. "at step 12"), or None;
    ``report``: where the hang report that names a lost peer is written."""
    text = str(error).strip()
    first = text.splitlines()[0] if text else type(error).__name__
    first = _SOURCE.sub("", first).split(". This is typically")[0][:200]
    lowered = text.lower()
    if isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and any(s in lowered for s in _MEMORY_SIGNS)
    ):
        return TrainingError(
            f"out of memory {where} ({first}): run `yatrain plan` for what fits; checkpoint "
            "more layers (sharding.activation_checkpoint_layers), lower data.micro_batch_size "
            "or use more devices"
        )
    if lost_peer(error):
        named = f" (the hang report, {report}, names it)" if report is not None else ""
        return LostPeer(
            f"lost contact with another rank {where} ({first}): it failed or was killed"
            f"{named}, and its own output says why; continue with --resume auto"
        )
    return None


def lost_peer(error: BaseException) -> bool:
    """Does ``error`` say a peer of this distributed run is gone?"""
    peer = isinstance(error, dist.DistError) or (
        isinstance(error, RuntimeError) and any(s in str(error).lower() for s in _PEER_SIGNS)
    )
    return peer and dist.is_available() and dist.is_initialized()
