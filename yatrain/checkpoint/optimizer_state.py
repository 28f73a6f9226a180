"""The optimizer's state as a checkpoint sees it: created before a load, one step counter.

torch creates optimizer state lazily at the first step; a load needs tensors to fill before
that. AdamW's groups (all of an AdamW run, the embedding, head and norms of a Muon run) keep
``exp_avg``, ``exp_avg_sq`` and a ``step`` that is the same number for every parameter, so
one is saved for all; Muon's matrices keep a ``momentum_buffer`` and no step.
"""

from __future__ import annotations

import torch

from yatrain.optim import ShardedMuon


def ensure_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the state (of an AdamW, or of a ``ShardedMuon`` and its AdamW) the way its
    first step would, so a checkpoint load has tensors to fill."""
    if isinstance(optimizer, ShardedMuon):
        optimizer.ensure_state()
    for group in _adamw(optimizer).param_groups:
        for param in group["params"]:
            if not optimizer.state[param]:
                optimizer.state[param] = {
                    "step": torch.zeros((), dtype=torch.float32, device=param.device),
                    "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
                }


def step_count(optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """AdamW's step counter of its first parameter: every parameter steps together, so a
    checkpoint saves this one and ``share_step_count`` hands it to the rest after a load."""
    adamw = _adamw(optimizer)
    return adamw.state[adamw.param_groups[0]["params"][0]]["step"]


def share_step_count(optimizer: torch.optim.Optimizer) -> None:
    step = step_count(optimizer)
    for group in _adamw(optimizer).param_groups:
        for param in group["params"]:
            optimizer.state[param]["step"].copy_(step)


def _adamw(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The AdamW whose state holds the step counter: the optimizer, or Muon's inner one."""
    return optimizer.adamw if isinstance(optimizer, ShardedMuon) else optimizer
