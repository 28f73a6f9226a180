"""This rank's fp32 master shards and the parameters the optimizer sees over them.

Every unit's shard is a view of one flat fp32 master (built by ``materialize.py``); each is
wrapped in an ``nn.Parameter`` with weight decay, and the small group (norms, biases) has a
parameter of its own without. A tied unit (``layout.borrows``) has no shard: it uses its
home unit's parameter, gradient and optimizer state. Each unit's fp32 gradient shard is a
tensor of its own, so it exists only from the unit's first reduction in a step to
``after_step``. One process computing in bf16 keeps a bf16 copy of every shard to compute
from, refreshed after each optimizer step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from yatrain.sharding.contract import InitHooks
from yatrain.sharding.layout import FlatLayout
from yatrain.sharding.materialize import materialize_shards


@dataclass
class MasterShards:
    """The fp32 masters, their parameters and (one process in bf16) their compute copies."""

    layouts: list[FlatLayout]
    home: list[int]  # the unit whose shard each unit uses: itself, or the one it borrows
    master: torch.Tensor  # every owned unit's shard, end to end
    small_master: torch.Tensor  # the small group's shard
    unit_offsets: list[int]  # where each unit's shard starts in ``master``
    unit_params: list[nn.Parameter]  # per unit (a tied unit's is its home's)
    small_param: nn.Parameter
    compute: torch.Tensor | None = None  # bf16 copy of ``master`` (one process, bf16)
    small_compute: torch.Tensor | None = None
    unit_master: list[torch.Tensor] = field(init=False)  # each unit's shard, a view of master
    owned: list[int] = field(init=False)  # the units that hold a shard of their own

    def __post_init__(self) -> None:
        self.unit_master = self.unit_views(self.master)
        self.owned = [i for i, home in enumerate(self.home) if home == i]

    @classmethod
    def build(
        cls,
        layouts: list[FlatLayout],
        small: FlatLayout,
        n_norm_slots: int,
        units: Sequence[nn.Module],
        norms: Sequence[nn.Module],
        init: InitHooks,
        *,
        device: torch.device,
        rank: int,
        compute_dtype: torch.dtype | None,
    ) -> MasterShards:
        """Materialise and fill the model one unit at a time, keeping this rank's shards;
        ``compute_dtype``: keep a copy in that dtype to compute from (one process)."""
        master, small_master, offsets = materialize_shards(
            layouts,
            small,
            n_norm_slots,
            units,
            norms,
            init_unit=init.unit,
            init_norms=init.norms,
            device=device,
            rank=rank,
        )
        home = [i if lay.borrows is None else lay.borrows for i, lay in enumerate(layouts)]
        params = [nn.Parameter(view) for view in _unit_views(master, offsets, layouts)]
        small_param = nn.Parameter(small_master)
        small_param.grad = torch.zeros_like(small_master)
        shards = cls(
            layouts,
            home,
            master,
            small_master,
            offsets,
            [params[h] for h in home],  # tied: one parameter
            small_param,
        )
        if compute_dtype is not None:
            shards.compute = master.to(compute_dtype)
            shards.small_compute = small_master.to(compute_dtype)
        return shards

    @property
    def owned_params(self) -> list[nn.Parameter]:
        """Each unit's shard once (a tied unit's is its home's)."""
        return [self.unit_params[i] for i in self.owned]

    def unit_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each unit's shard inside a tensor laid out like the flat master."""
        return _unit_views(flat, self.unit_offsets, self.layouts)

    @property
    def small_grad(self) -> torch.Tensor:
        """The small group's fp32 gradient shard (kept for the engine's whole life)."""
        grad = self.small_param.grad
        if grad is None:
            raise RuntimeError("the norm group's gradient was set to None outside the engine")
        return grad

    def grad_shard(self, unit: int) -> torch.Tensor:
        """Unit ``unit``'s fp32 gradient shard, allocated (not zeroed) at the unit's first
        reduction in a step, which writes all of it; freed by ``after_step``."""
        param = self.unit_params[unit]
        if param.grad is None:
            param.grad = torch.empty_like(param)
        return param.grad

    def after_step(self) -> None:
        """Free the gradient shards; refresh the compute copy from the new masters."""
        if self.compute is not None and self.small_compute is not None:
            self.compute.copy_(self.master)
            self.small_compute.copy_(self.small_master)
        for param in self.unit_params:
            param.grad = None


def _unit_views(
    flat: torch.Tensor, offsets: Sequence[int], layouts: Sequence[FlatLayout]
) -> list[torch.Tensor]:
    return [flat.narrow(0, off, lay.shard_numel) for off, lay in zip(offsets, layouts, strict=True)]
