"""Learning rate: linear warm-up, then cosine decay to ``min_lr`` at the last step."""

from __future__ import annotations

import math


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, total_steps: int) -> float:
    """LR for optimizer step ``step`` (1-based): step 1 of a warm-up already moves."""
    if warmup_steps > 0 and step <= warmup_steps:
        return lr * step / warmup_steps
    decay_steps = max(total_steps - warmup_steps, 1)
    progress = min(max(step - warmup_steps, 0) / decay_steps, 1.0)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))
