"""Context parallelism on the training side: a micro-batch's windows cut for this rank, and
attention over the window's gathered keys and values.

Every rank of a CP group reads the same windows (its data rank's slice of the global batch).
Document ids and rotary positions are computed on the whole window first (the loader's
``attention_inputs``), then inputs, targets, ids and positions are cut into this rank's two
chunks (``context_parallel.group.ContextGroup.split``), so RoPE sees each token's place in the
window and the document mask follows the window's documents. The model gets the chunks, their
positions and a ``GatheredAttention`` as its ``attention`` (``models.llama.Attend``): in
every layer it gathers the window's keys and values (one all-gather, reduce-scattered in the
backward) and attends each local chunk's queries to the keys up to the chunk's end.

The loss: each rank's loss is the mean over its own chunks' tokens (every rank holds the same
number), so the engine's gradient factor 1 / (world x micro-batches) gives the mean over the
global batch, as without CP.
"""

from __future__ import annotations

import torch

from yatrain.context_parallel.attention import GatheredAttention
from yatrain.context_parallel.group import ContextGroup
from yatrain.recipe.topology import JobLayout
from yatrain.sharding.timing import IntervalClock


class ContextParallel:
    """This rank's part of each window, and the attention that joins the parts."""

    def __init__(self, group: ContextGroup) -> None:
        self.group = group

    @classmethod
    def of_layout(
        cls, layout: JobLayout, device: torch.device, cuda_path: bool = False
    ) -> ContextParallel | None:
        """The layout's CP groups over this run's ranks (collective), or None at 1;
        ``cuda_path``: the CUDA communicator on a CPU, as the engine's (a dry run)."""
        if layout.context == 1:
            return None
        return cls(ContextGroup.build(layout.context, device, cuda_path))

    @property
    def size(self) -> int:
        return self.group.size

    def time_waits(self, clock: IntervalClock) -> None:
        """Count the waits on K/V collectives as exposed communication (the engine's
        ``waits`` clock)."""
        self.group.comm.clock = clock

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank sent in the K/V collectives (forward gathers, backward
        reduce-scatters, a checkpointed layer's re-gathers)."""
        return self.group.bytes_sent

    def localize(
        self, inputs: torch.Tensor, targets: torch.Tensor, extra: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """Whole windows (inputs, targets [B, T], the model inputs computed on them) ->
        this rank's chunks, their window positions and the attention over the window."""
        batch, seq_len = inputs.shape
        positions = extra.get("positions")
        if positions is None:
            positions = torch.arange(seq_len, device=inputs.device).expand(batch, seq_len)
        split = self.group.split
        attention = GatheredAttention(self.group, seq_len, extra.get("document_ids"))
        local = {"positions": split(positions), "attention": attention}
        return split(inputs), split(targets), local
