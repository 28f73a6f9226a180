"""AdamW over the engine's flat shards: one multi-tensor call over a handful of tensors."""

from __future__ import annotations

import torch

from yatrain.config import OptimConfig


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


def ensure_state(optimizer: torch.optim.AdamW) -> None:
    """Create AdamW's state the way its first step would, so a checkpoint load has tensors
    to fill."""
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
