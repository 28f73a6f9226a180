"""The plain PyTorch step every baseline runs: a replicated model (alone, or under DDP),
AdamW with the engine's decay groups, global-norm clipping, ``zero_grad(set_to_none=True)``;
bf16 means autocast with fp32 weights, the plain-PyTorch way."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
from torch import nn

from yatrain.models.loss import cross_entropy


def decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups as the engine makes them: tensors of rank >= 2 decay, the rest do not."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def bare_adamw(groups: list[dict], lr: float, *, fused: bool = True, **kwargs):
    """Plain AdamW, fused when this build supports it for the device, else foreach."""
    if fused:
        try:
            return torch.optim.AdamW(groups, lr=lr, fused=True, **kwargs)
        except (RuntimeError, ValueError):
            pass
    return torch.optim.AdamW(groups, lr=lr, foreach=True, **kwargs)


def autocast_context(device: torch.device, dtype: torch.dtype):
    """Mixed precision the plain-PyTorch way: fp32 weights, bf16 autocast regions."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def bare_step(
    run: Callable[[torch.Tensor], torch.Tensor],
    params: list[nn.Parameter],
    optimizer: torch.optim.Optimizer,
    micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    *,
    device: torch.device,
    dtype: torch.dtype,
    clip: float,
    no_sync: Callable | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One plain optimizer step; returns (mean loss, gradient norm). ``run`` is the model
    (or its DDP wrapper); ``no_sync`` (DDP) skips the all-reduce on all but the last
    micro-batch."""
    total = torch.zeros((), device=device)
    for i, (inputs, targets) in enumerate(micro_batches):
        defer = no_sync is not None and i < len(micro_batches) - 1
        with no_sync() if defer else contextlib.nullcontext():
            with autocast_context(device, dtype):
                loss = cross_entropy(run(inputs.to(device)), targets.to(device))
            (loss / len(micro_batches)).backward()
        total += loss.detach()
    grad_norm = torch.nn.utils.clip_grad_norm_(params, clip, foreach=True)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total / len(micro_batches), grad_norm
