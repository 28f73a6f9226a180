"""The run's optimizer over the engine's shards: AdamW, or Muon for the decoder's matrices
(``optim.name``); the learning rate each step and a step the device may skip."""

from __future__ import annotations

import torch

from yatrain.common import DTYPES
from yatrain.models.llama import DecoderLayer
from yatrain.optim import ShardedMuon, fused_adamw
from yatrain.recipe.config import OptimConfig
from yatrain.sharding import ShardableModel, ShardedEngine


def build_optimizer(param_groups: list[dict], cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW over ``param_groups`` (the engine's: which tensors decay is theirs to say)."""
    return fused_adamw(param_groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)


def run_optimizer(
    engine: ShardedEngine, model: ShardableModel, cfg: OptimConfig
) -> torch.optim.Optimizer:
    """The optimizer ``optim.name`` names. Muon takes each decoder layer's unit (its seven
    projection matrices; the routing follows the units, never ``ndim``), AdamW the
    embedding, the head and the small group, with the recipe's betas, eps, rate and decay."""
    if cfg.name == "adamw":
        return build_optimizer(engine.param_groups(cfg.weight_decay), cfg)
    muon = cfg.muon()
    layers = {i for i, unit in enumerate(model.units()) if isinstance(unit, DecoderLayer)}
    groups = engine.unit_groups(cfg.weight_decay)
    for group in groups:
        group["kind"] = "muon" if group["unit"] in layers else "adamw"
        if group["kind"] == "muon":
            group["lr_scale"] = muon["lr"] / cfg.lr  # set_lr: the schedule scales both alike
    maps = [engine.matrix_map(g["unit"]) for g in groups if g["kind"] == "muon"]
    return ShardedMuon(
        groups,
        maps,
        engine.comm,
        lr=muon["lr"],
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        momentum=muon["momentum"],
        nesterov=muon["nesterov"],
        ns_steps=muon["ns_steps"],
        ns_dtype=DTYPES[muon["ns_dtype"]],
        adjust_lr=muon["adjust_lr"],
    )


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """The schedule's rate ``lr`` for this step (a Muon group's times its ``lr_scale``)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)


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
