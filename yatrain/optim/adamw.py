"""AdamW over the engine's flat shards: one multi-tensor call over a handful of tensors."""

from __future__ import annotations

from typing import Any

from torch.optim import AdamW


def fused_adamw(
    groups: list[dict[str, Any]], *, lr: float, betas: tuple[float, float], eps: float
) -> AdamW:
    """Decoupled weight decay; the groups already say which tensors decay (none on norms).

    ``fused`` runs the whole update as one kernel per tensor on CUDA and CPU and takes the
    device's ``found_inf`` flag (``optim.skip.step_unless``); it falls back to ``foreach``
    where the build lacks it. The LR is set by the loop every step."""
    device = groups[0]["params"][0].device
    try:
        return AdamW(groups, lr=lr, betas=betas, eps=eps, fused=device.type in ("cuda", "cpu"))
    except (RuntimeError, ValueError):
        return AdamW(groups, lr=lr, betas=betas, eps=eps, foreach=True)
