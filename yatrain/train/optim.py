"""The run's optimizer over the engine's shards (``optim.name``) and each step's rate."""

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
        replicas=engine.replica_comm if muon["hsdp"] == "split" else None,
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
