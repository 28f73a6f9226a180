"""A step the device may skip: the optimizer's update applied or not by a device flag,
without the host reading it (the guard's non-finite check, ``train/guard.py``)."""

from __future__ import annotations

import torch


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
            if isinstance(value, torch.Tensor):
                old = state.get(key)
                old = old if isinstance(old, torch.Tensor) else torch.zeros_like(value)
                value.copy_(torch.where(keep, old, value))


def _copy(value: object) -> object:
    return value.clone() if isinstance(value, torch.Tensor) else value
