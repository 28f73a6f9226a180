"""Muon for the decoder's matrices and AdamW for the rest, as one optimizer over the shards.

``torch.optim.Muon`` takes whole 2-D tensors in one process: it refuses the engine's flat
shards, and orthogonalising each rank's piece on its own would be wrong. Here torch's
arithmetic runs where the state lives: momentum (``buf.lerp_(g, 1 - momentum)``), Nesterov
(``g.lerp(buf, momentum)``), decoupled weight decay and the final add on each rank's fp32
shards; only the orthogonalisation needs whole matrices, which ``MatrixExchange`` gives to
one owner per matrix. The AdamW groups (embedding, head, the small group) stay one fused
call. Every group is tagged ``kind``: ``muon`` or ``adamw``; they share one state table, so
the trainer, the guard and the checkpoints see one optimizer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.optim import Optimizer

from yatrain.common import DTYPES
from yatrain.models.llama import DecoderLayer
from yatrain.optim.adamw import fused_adamw
from yatrain.optim.exchange import MatrixExchange
from yatrain.optim.exchange_plan import Sent, bucket_numel
from yatrain.optim.newton_schulz import adjusted_lr
from yatrain.recipe.config import OptimConfig
from yatrain.sharding import ShardableModel, ShardedEngine
from yatrain.sharding.comm import Communicator
from yatrain.sharding.layout import MatrixMap

MOMENTUM = "momentum_buffer"  # torch.optim.Muon's name for it, and the checkpoints'


class ShardedMuon(Optimizer):
    """``groups``: the engine's groups, each tagged ``kind``; a ``muon`` group is one unit's
    shard and ``maps`` gives its matrix map, in the same order. A non-finite step (the
    ``found_inf`` flag of ``optim.skip.step_unless``, as fused AdamW takes it) leaves the
    weights and every state bitwise as they were, decided on the device; the exchange runs
    all the same (it is collective). ``replicas``: the replicas' communicator under hybrid
    sharding, to split the matrices' owners over the whole world (``optim.muon_hsdp:
    split``); None: each replica orthogonalises every matrix (``repeat``). ``bucket_mib``:
    the decoder layers' matrices exchanged together, about this many MiB of whole matrices
    in ``ns_dtype`` (``optim.muon_bucket_mib``); None: all at once."""

    def __init__(
        self,
        groups: Sequence[dict[str, Any]],
        maps: Sequence[MatrixMap],
        comm: Communicator,
        *,
        replicas: Communicator | None = None,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        ns_dtype: torch.dtype = torch.bfloat16,
        adjust_lr: str = "match_rms_adamw",
        bucket_mib: float | None = None,
    ) -> None:
        adamw_groups = [g for g in groups if g["kind"] == "adamw"]
        self.adamw = fused_adamw(adamw_groups, lr=lr, betas=betas, eps=eps)
        defaults = dict(
            lr=lr,
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            adjust_lr=adjust_lr,
            fused=bool(self.adamw.defaults.get("fused")),  # takes found_inf (step_unless)
        )
        super().__init__(list(groups), defaults)
        self.state = self.adamw.state  # one table: AdamW's moments and Muon's momentum
        self.ns_dtype = ns_dtype
        buckets = bucket_numel(bucket_mib, ns_dtype)
        self.exchange = MatrixExchange(maps, comm, replicas, buckets)
        self.found_inf: torch.Tensor | None = None

    @property
    def muon_groups(self) -> list[dict[str, Any]]:
        return [g for g in self.param_groups if g["kind"] == "muon"]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One step of both; ``found_inf`` (a device flag, 1.0 = skip) as fused AdamW's."""
        skip = self.found_inf
        self.adamw.found_inf = skip  # type: ignore[attr-defined]
        try:
            self.adamw.step()
        finally:
            self.adamw.found_inf = None  # type: ignore[attr-defined]
        self._muon_step(None if skip is None else skip > 0)
        return None

    def ensure_state(self) -> None:
        """Each Muon shard's momentum as its first step would create it (a checkpoint load
        fills it); AdamW's state is its own business (``checkpoint.optimizer_state``)."""
        for group in self.muon_groups:
            param = group["params"][0]
            if MOMENTUM not in self.state[param]:
                self.state[param][MOMENTUM] = torch.zeros_like(param)

    def _muon_step(self, keep: torch.Tensor | None) -> None:
        groups = self.muon_groups
        if not groups:
            return
        self.ensure_state()
        updates = [self._momentum(group, keep) for group in groups]
        params = [g["params"][0].detach() for g in groups]
        targets = [p if keep is None else p.clone() for p in params]
        for group, target in zip(groups, targets, strict=True):
            target.mul_(1 - group["lr"] * group["weight_decay"])  # with the unadjusted rate

        def land(pieces: Sequence[Sent], back: torch.Tensor) -> None:
            for piece in pieces:  # a bucket's, as its results arrive
                group, shape = groups[piece.unit], self.exchange.shapes[piece.matrix]
                rate = adjusted_lr(group["lr"], group["adjust_lr"], shape)
                segment = targets[piece.unit].narrow(0, piece.in_shard, piece.length)
                segment.add_(back.narrow(0, piece.at, piece.length), alpha=-rate)

        self.exchange.orthogonalize(updates, groups[0]["ns_steps"], self.ns_dtype, land)
        if keep is not None:
            for param, target in zip(params, targets, strict=True):
                param.copy_(torch.where(keep, param, target))

    def _momentum(self, group: dict[str, Any], keep: torch.Tensor | None) -> torch.Tensor:
        """Update the momentum (unless ``keep``) and return the update to orthogonalise."""
        param = group["params"][0]
        if param.grad is None:
            raise RuntimeError("a Muon shard has no gradient: the engine reduces every unit")
        grad, buf, momentum = param.grad, self.state[param][MOMENTUM], group["momentum"]
        new = buf.lerp_(grad, 1 - momentum) if keep is None else buf.lerp(grad, 1 - momentum)
        update = grad.lerp(new, momentum) if group["nesterov"] else new
        if keep is not None:
            buf.copy_(torch.where(keep, buf, new))
        return update


def muon_for(engine: ShardedEngine, model: ShardableModel, cfg: OptimConfig) -> ShardedMuon:
    """``optim.name: muon``: Muon takes each decoder layer's unit (its seven projection
    matrices; the routing follows the units, never ``ndim``), AdamW the embedding, the head
    and the small group, with the recipe's betas, eps, rate and decay."""
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
        bucket_mib=muon["bucket_mib"],
    )
