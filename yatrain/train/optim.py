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


def step_unless(optimizer: torch.optim.Optimizer, skip: torch.Tensor | None) -> None:
    """``optimizer.step()``, unless the device flag ``skip`` (float32, exactly 0.0 or 1.0)
    is 1.0: then the weights and the optimizer state stay bitwise as they were, decided on
    the device without the host reading the flag. A fused AdamW takes it as ``found_inf``
    (as ``GradScaler`` hands it: 1.0 leaves weights, moments and ``step`` unchanged); any
    other optimizer gets a masked step (``_masked_step``)."""
    if skip is None:
        optimizer.step()
    elif optimizer.defaults.get("fused"):
        optimizer.found_inf = skip  # type: ignore[attr-defined]
        try:
            optimizer.step()
        finally:
            optimizer.found_inf = None  # type: ignore[attr-defined]
    else:
        _masked_step(optimizer, skip)


def _masked_step(optimizer: torch.optim.Optimizer, skip: torch.Tensor) -> None:
    """Step, then put back every weight and state tensor where ``skip`` is 1.0 (a state not
    created yet goes back to zeros, the value its optimizer creates it with). It holds a
    copy of the weights and the state during the step: only optimizers without ``found_inf``
    pay that (the fallback where a build lacks fused AdamW)."""
    keep = skip > 0
    params = [p for group in optimizer.param_groups for p in group["params"]]
    before = {
        p: (p.detach().clone(), {k: _copy(v) for k, v in optimizer.state[p].items()})
        for p in params
        if p.grad is not None
    }
    optimizer.step()
    for p, (weights, state) in before.items():
        p.detach().copy_(torch.where(keep, weights, p.detach()))
        for key, value in optimizer.state[p].items():
            if torch.is_tensor(value):
                old = state.get(key, torch.zeros_like(value))
                value.copy_(torch.where(keep, old, value))


def _copy(value: object) -> object:
    return value.clone() if isinstance(value, torch.Tensor) else value
