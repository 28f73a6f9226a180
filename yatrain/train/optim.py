"""AdamW over the engine's flat shards: one multi-tensor call over a handful of tensors."""

from __future__ import annotations

import torch

from yatrain.recipe.config import OptimConfig


def build_optimizer(param_groups: list[dict], cfg: OptimConfig) -> torch.optim.AdamW:
    """Decoupled weight decay; the groups already say which tensors decay (none on norms).

    ``fused`` runs the whole update as one kernel per tensor on CUDA and CPU; it falls back
    to ``foreach`` where the build lacks it. The LR is set by the loop every step.
    """
    device = param_groups[0]["params"][0].device
    kwargs = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    try:
        return torch.optim.AdamW(param_groups, fused=device.type in ("cuda", "cpu"), **kwargs)
    except (RuntimeError, ValueError):
        return torch.optim.AdamW(param_groups, foreach=True, **kwargs)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
