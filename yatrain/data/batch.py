"""A micro-batch as the training step and the evaluator get it: the windows' inputs and
targets, and the model inputs computed on the whole windows (document ids, restarted
positions), so that neither has to be told how to derive them.

The loader and the held-out windows make them (``BatchLoader.attention_inputs``); an
(inputs, targets) pair is a micro-batch without model inputs (the plain causal path).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple

import torch

NO_MODEL_INPUTS: Mapping[str, torch.Tensor] = MappingProxyType({})


class MicroBatch(NamedTuple):
    inputs: torch.Tensor  # int64 [micro, seq_len]
    targets: torch.Tensor  # int64 [micro, seq_len]; IGNORE_INDEX where nothing is predicted
    extra: Mapping[str, torch.Tensor] = NO_MODEL_INPUTS  # the model's other arguments

    def to(self, device: torch.device) -> MicroBatch:
        """The same micro-batch on ``device`` (copies queued, not waited for)."""
        extra = {name: value.to(device, non_blocking=True) for name, value in self.extra.items()}
        return MicroBatch(
            self.inputs.to(device, non_blocking=True),
            self.targets.to(device, non_blocking=True),
            extra,
        )
