"""The sharded data-parallel engine: flat fp32 master shards, reused buffers, overlapped comms.

The model is described as an ordered list of units (embedding, decoder layers, output head)
plus its norm modules (``contract.ShardableModel``). Each unit's weights are flattened and
sharded across ranks; during a unit's forward and backward its parameters are views into a
preallocated gather buffer (``buffers.py``, allocated once, never freed) and its gradient
lands as one flat tensor in a preallocated gradient buffer. Norm weights (and any other 1-D
parameter) form one small group gathered once and reduced once per step. The per-unit
schedule of gathers and reductions lives in ``hooks.py``; the saved state in ``state.py``.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn

from yatrain.sharding.buffers import Buffer, GradSlot, gather_buffers, grad_slots
from yatrain.sharding.comm import Communicator, Handle, make_communicator
from yatrain.sharding.contract import InitHooks, ShardableModel
from yatrain.sharding.hooks import UnitSchedule
from yatrain.sharding.layout import plan_layouts
from yatrain.sharding.materialize import materialize_shards
from yatrain.sharding.state import ShardView, StateEntry, shard_views, state_entries


class ShardedEngine(UnitSchedule):
    """Owns the model's weights as flat shards and drives gathers and reductions via hooks.

    Build it with ``ShardedEngine.from_model``. The caller runs forward/backward as usual,
    then ``reduce_gradients()``, ``clip_grad_norm_()``, ``optimizer.step()`` and
    ``after_step()`` (``yatrain.train.step.train_step`` is that sequence). The engine owns
    its state: ``param_groups()`` for the optimizer, ``sharded_state()`` and
    ``state_layout`` for checkpoints.
    """

    def __init__(
        self,
        model: ShardableModel,
        init: InitHooks,
        *,
        device: torch.device | str,
        param_dtype: torch.dtype = torch.float32,
        reduce_dtype: torch.dtype = torch.float32,
        prefetch_depth: int = 1,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        if prefetch_depth < 1:
            raise ValueError("prefetch_depth must be at least 1")
        self.device = torch.device(device)
        self.comm: Communicator = make_communicator(group, self.device)
        self.world_size, self.rank = self.comm.world_size, self.comm.rank
        self.direct = self.world_size == 1
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self.prefetch_depth = prefetch_depth
        units, norms = list(model.units()), list(model.norm_modules())
        self.n_units = len(units)

        self.layouts, self.small, self.n_norm_slots = plan_layouts(
            model, units, norms, self.world_size
        )
        self._materialize(units, norms, init)
        self._allocate_buffers()
        self._reset_step_state()
        for index, unit in enumerate(units):
            unit.register_forward_pre_hook(functools.partial(self._pre_forward, index))
            unit.register_forward_hook(functools.partial(self._post_forward, index))

    @classmethod
    def from_model(
        cls,
        model: ShardableModel,
        *,
        device: torch.device | str,
        seed: int = 0,
        init: InitHooks | None = None,
        **options,
    ) -> ShardedEngine:
        """Shard a meta-device ``model``: each rank materialises one unit at a time, fills
        it (``init``, default: the model's own initialisation from ``seed``) and keeps only
        its shard. ``options``: ``param_dtype``, ``reduce_dtype``, ``prefetch_depth``,
        ``group``."""
        return cls(model, init or InitHooks.from_seed(model, seed), device=device, **options)

    # ------------------------------------------------------------------ construction
    def _materialize(self, units, norms, init: InitHooks) -> None:
        """Each rank's fp32 master shards, built one unit at a time (see materialize.py)."""
        self.master, self.small_master, self.unit_offsets = materialize_shards(
            self.layouts, self.small, self.n_norm_slots, units, norms,
            init_unit=init.unit, init_norms=init.norms, device=self.device, rank=self.rank,
        )  # fmt: skip
        self.unit_master = self._unit_views(self.master)

        # Parameters the optimizer sees: one flat tensor with weight decay, one without.
        self.flat_param = nn.Parameter(self.master)
        self.flat_param.grad = torch.zeros_like(self.master)
        self.small_param = nn.Parameter(self.small_master)
        self.small_param.grad = torch.zeros_like(self.small_master)
        self.unit_grad = self._unit_views(self.flat_param.grad)
        # The copy used as all-gather input: the master itself in fp32, else a cast copy.
        same = self.param_dtype == torch.float32
        self.compute = self.master if same else self.master.to(self.param_dtype)
        self.small_compute = self.small_master if same else self.small_master.to(self.param_dtype)
        self.unit_compute = self._unit_views(self.compute)

    def _unit_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each unit's shard inside a tensor laid out like the flat master."""
        return [
            flat.narrow(0, off, lay.shard_numel)
            for off, lay in zip(self.unit_offsets, self.layouts, strict=True)
        ]

    def _allocate_buffers(self) -> None:
        """Gather buffers and gradient slots (buffers.py); at world size 1 every unit
        computes straight from its shard, and fp32 gradients land straight in theirs."""
        pdt, rdt = self.param_dtype, self.reduce_dtype
        if self.direct:
            self.buffer_of = [
                Buffer(compute, owner=i, fixed=True) for i, compute in enumerate(self.unit_compute)
            ]
        else:
            self.buffer_of = gather_buffers(self.layouts, self.prefetch_depth, pdt, self.device)
        grads_direct = self.direct and pdt == torch.float32
        staging = not self.direct and pdt != rdt  # bf16 gradients, fp32 reduction
        self.slot_of: list[GradSlot | None] = (
            [None] * self.n_units
            if grads_direct
            else grad_slots(self.layouts, pdt, rdt, staging, self.device)
        )
        self._staging: Handle | None = None  # the last reduce-scatter that used staging

        # The small group (norms): gathered once per step, its gradient reduced once.
        small_n = self.small.padded_numel
        zeros = functools.partial(torch.zeros, device=self.device)
        self.small_buffer = self.small_compute if self.direct else zeros(small_n, dtype=pdt)
        self.small_grad = (  # accumulates over micro-batches
            self.small_param.grad if grads_direct else zeros(small_n, dtype=pdt)
        )
        self.small_out = None if self.direct else zeros(self.small.shard_numel, dtype=rdt)

    # ------------------------------------------------------------------ the step
    def reduce_gradients(self) -> None:
        """Finish every reduction of this step and average over ranks and micro-batches."""
        for index, state in enumerate(self.state):
            if state != "done" and self.leaves[index]:
                names = [s.name for s in self.layouts[index].slots]
                raise RuntimeError(f"unit {index} ({names[0]}, ...) received no gradient")
        for handle in self.pending:
            self.comm.wait(handle)
        self.pending.clear()
        if self.direct:
            if self.small_grad is not self.small_param.grad:
                self.small_param.grad.add_(self.small_grad)
        else:
            full = self.small_grad
            if full.dtype != self.reduce_dtype:
                full = full.to(self.reduce_dtype)
            self.comm.wait(self.comm.reduce_scatter(self.small_out, full))
            self.small_param.grad.add_(self.small_out)
        scale = 1.0 / (self.world_size * max(self.micro_batches, 1))
        if scale != 1.0:
            self.flat_param.grad.mul_(scale)
            self.small_param.grad.mul_(scale)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Exact global L2 norm across all shards (one all-reduce); clip when max_norm > 0."""
        # vector_norm reduces in place: no temporary the size of the gradient shard.
        squares = (
            torch.linalg.vector_norm(self.flat_param.grad) ** 2
            + torch.linalg.vector_norm(self.small_param.grad) ** 2
        )
        self.comm.all_reduce_sum(squares)
        norm = squares.sqrt()
        if max_norm > 0:
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            self.flat_param.grad.mul_(coef)
            self.small_param.grad.mul_(coef)
        return norm

    def after_step(self) -> None:
        """Refresh the gather inputs from the updated masters; clear gradients and buffers."""
        if self.compute is not self.master:
            self.compute.copy_(self.master)
            self.small_compute.copy_(self.small_master)
        self.flat_param.grad.zero_()
        self.small_param.grad.zero_()
        if self.small_grad is not self.small_param.grad:
            self.small_grad.zero_()
        for buf in self.buffer_of:
            if not buf.fixed:
                buf.owner = None
        self._reset_step_state()

    def param_groups(self, weight_decay: float) -> list[dict]:
        """Two flat tensors: unit weights (decayed) and the small group (norms, biases)."""
        return [
            {"params": [self.flat_param], "weight_decay": weight_decay},
            {"params": [self.small_param], "weight_decay": 0.0},
        ]

    # ------------------------------------------------------------------ saved state
    @property
    def state_layout(self) -> list[StateEntry]:
        """The flat tensors a checkpoint of this engine holds (what one must match)."""
        return state_entries(self.layouts, self.small)

    def sharded_state(
        self, optimizer: torch.optim.Optimizer | None = None
    ) -> dict[str, dict[str, ShardView]]:
        """This rank's piece of every flat tensor, with its global offset: ``"model"`` for
        the fp32 master weights, and one group per optimizer state tensor shaped like the
        weights (AdamW: ``exp_avg``, ``exp_avg_sq``). Views, no copies: loading into them
        restores the engine."""
        groups = {"model": (self.flat_param, self.small_param)}
        if optimizer is not None:
            flat, small = optimizer.state[self.flat_param], optimizer.state[self.small_param]
            for name, value in flat.items():
                if torch.is_tensor(value) and value.shape == self.flat_param.shape:
                    groups[name] = (value, small[name])
        entries = self.state_layout
        return {
            group: shard_views(
                entries, [*self.layouts, self.small], self.rank, [*self._unit_views(f), s]
            )
            for group, (f, s) in groups.items()
        }

    @property
    def bytes_sent(self) -> int:
        return self.comm.bytes_sent

    # ------------------------------------------------------------------ full weights
    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter in fp32 on CPU, gathered one unit at a time (tests and export)."""
        result = {}
        pairs = [(lay, self.unit_master[i]) for i, lay in enumerate(self.layouts)]
        for layout, shard in [*pairs, (self.small, self.small_master)]:
            full = torch.empty(layout.padded_numel, dtype=torch.float32, device=self.device)
            self.comm.wait(self.comm.all_gather(full, shard))
            for slot, view in zip(layout.slots, layout.views(full), strict=True):
                result[slot.name] = view.detach().cpu().clone()
        return result
