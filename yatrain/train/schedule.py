"""Learning rate per step (``optim.schedule``): linear warm-up, then

- ``cosine`` (default): cosine decay from ``lr`` to ``min_lr`` at the last step;
- ``wsd`` (warm-up, stable, decay; torchtitan's ``decay_ratio``): ``lr`` until the last
  ``decay_fraction`` of the steps, then down to ``min_lr`` at the last step, shaped by
  ``decay_shape`` (``linear``, ``sqrt``: 1 - sqrt(progress), ``cosine``);
- ``constant``: ``lr`` after the warm-up (``min_lr`` unused).

Every phase is placed against ``train.steps``: resuming with a larger ``train.steps``
stretches the cosine and moves the wsd decay to the new last fraction; a run resumed in
the stable phase continues at ``lr`` as if it had always been that long.
"""

from __future__ import annotations

import math

from yatrain.recipe.config import OptimConfig

_SHAPES = {
    "linear": lambda progress: 1.0 - progress,
    "sqrt": lambda progress: 1.0 - math.sqrt(progress),
    "cosine": lambda progress: 0.5 * (1.0 + math.cos(math.pi * progress)),
}


def lr_at(step: int, optim: OptimConfig, total_steps: int) -> float:
    """LR for optimizer step ``step`` (1-based): step 1 of a warm-up already moves."""
    lr, min_lr, warmup = optim.lr, optim.min_lr, optim.warmup_steps
    if warmup > 0 and step <= warmup:
        return lr * step / warmup
    if optim.schedule == "constant":
        return lr
    if optim.schedule == "wsd":
        decay_steps = max(round(optim.decay_fraction * total_steps), 1)
        decay_start = max(total_steps - decay_steps, warmup)
        shape, span = _SHAPES[optim.decay_shape], max(total_steps - decay_start, 1)
    else:
        decay_start, shape = warmup, _SHAPES["cosine"]
        span = max(total_steps - warmup, 1)
    progress = min(max(step - decay_start, 0) / span, 1.0)
    return min_lr + (lr - min_lr) * shape(progress)
