"""AdamW's state as a checkpoint sees it: created before a load, one step counter saved.

torch creates AdamW's state lazily at the first step; a load needs tensors to fill before
that, and every parameter's ``step`` is the same number, so one is saved for all.
"""

from __future__ import annotations

import torch


def ensure_state(optimizer: torch.optim.Optimizer) -> None:
    """Create AdamW's state (``optimizer`` is an AdamW) the way its first step would, so a
    checkpoint load has tensors to fill."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            if not optimizer.state[param]:
                optimizer.state[param] = {
                    "step": torch.zeros((), dtype=torch.float32, device=param.device),
                    "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
                }


def step_count(optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """The step counter of the first parameter: every parameter steps together, so a
    checkpoint saves this one and ``share_step_count`` hands it to the rest after a load."""
    return optimizer.state[optimizer.param_groups[0]["params"][0]]["step"]


def share_step_count(optimizer: torch.optim.Optimizer) -> None:
    step = step_count(optimizer)
    for group in optimizer.param_groups:
        for param in group["params"]:
            optimizer.state[param]["step"].copy_(step)
