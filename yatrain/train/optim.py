"""The run's optimizer over the engine's shards (``optim.name``) and each step's rate."""

from __future__ import annotations

import torch

from yatrain.optim import fused_adamw, muon_for
from yatrain.recipe.config import OptimConfig
from yatrain.sharding import ShardableModel, ShardedEngine


def build_optimizer(param_groups: list[dict], cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW over ``param_groups`` (the engine's: which tensors decay is theirs to say)."""
    return fused_adamw(param_groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)


def run_optimizer(
    engine: ShardedEngine, model: ShardableModel, cfg: OptimConfig
) -> torch.optim.Optimizer:
    """The optimizer ``optim.name`` names: AdamW, or Muon for the decoder layers' matrices
    and AdamW for the rest (``optim.muon.muon_for``)."""
    if cfg.name == "adamw":
        return build_optimizer(engine.param_groups(cfg.weight_decay), cfg)
    return muon_for(engine, model, cfg)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """The schedule's rate ``lr`` for this step (a Muon group's times its ``lr_scale``)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
