"""The sharded data-parallel engine: flat fp32 master shards, reused buffers, overlapped comms.

The model is described as an ordered list of units (embedding, decoder layers, output head)
plus its norm modules (``contract.ShardableModel``). Each unit's weights are flattened and
sharded across ranks; during a unit's forward and backward its parameters are views into a
preallocated gather buffer (sized by ``sizes.engine_buffers``, allocated once in
``buffers.py``, never freed) and its gradient is reduce-scattered in pieces into the unit's
fp32 gradient shard (``reduce.py``). Norm weights (and any other 1-D parameter) form one
small group gathered once and reduced once per step. The per-unit schedule of gathers and
reductions lives in ``hooks.py``; the saved state in ``state.py``.

The fp32 gradient shard exists only from a step's first reduction to its ``after_step``:
the first micro-batch's reductions write it (nothing is zeroed), later ones add to it, and
no forward that does not need it holds it.
"""

from __future__ import annotations

import functools
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from yatrain.sharding.buffers import Buffer, gather_buffers, grad_slots
from yatrain.sharding.comm import Communicator, CudaStreamCommunicator
from yatrain.sharding.contract import InitHooks, ShardableModel, backward_reads_weights
from yatrain.sharding.float8 import Float8Format, Float8Gathers
from yatrain.sharding.gradients import GradientFinish
from yatrain.sharding.groups import communicators
from yatrain.sharding.hooks import UnitSchedule
from yatrain.sharding.layout import plan_layouts
from yatrain.sharding.materialize import materialize_shards
from yatrain.sharding.reduce import PieceReducer, StreamReducer, ThreadReducer
from yatrain.sharding.sizes import PIECE_NUMEL, EngineBuffers, engine_buffers
from yatrain.sharding.state import ShardView, StateEntry, shard_views, state_entries
from yatrain.sharding.timing import IntervalClock


class ShardedEngine(GradientFinish, UnitSchedule):
    """Owns the model's weights as flat shards and drives gathers and reductions via hooks.

    Build it with ``ShardedEngine.from_model``. The caller runs forward/backward as usual,
    then ``reduce_gradients()``, ``clip_grad_norm_()`` (which also averages the gradients
    over ranks and micro-batches, in the same pass as the clipping), ``optimizer.step()``
    and ``after_step()`` (``yatrain.train.step.train_step`` is that sequence). The engine
    owns its state: ``param_groups()`` for the optimizer, ``sharded_state()`` and
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
        mesh: DeviceMesh | None = None,
        force_process_group: bool = False,
        piece_numel: int = PIECE_NUMEL,
        float8: Float8Format | None = None,
    ) -> None:
        if prefetch_depth < 1:
            raise ValueError("prefetch_depth must be at least 1")
        self.device = torch.device(device)
        self.mesh = mesh  # a checkpoint is sharded over it too (groups.py)
        self.comm, self.replica_comm = communicators(
            group, mesh, self.device, force_group=force_process_group
        )
        # shard_size ranks share each unit; world_size ranks (replicas x shard group) train.
        self.shard_size, self.rank = self.comm.world_size, self.comm.rank
        self.replicas = self.replica_comm.world_size if self.replica_comm else 1
        self.world_size = self.shard_size * self.replicas
        self.direct = type(self.comm) is Communicator  # one process, no group: no buffers
        # Exposed communication: the waits on gathers and reductions (timing.py), timed
        # while a caller turns it on (train_step does, around its step).
        self.waits = IntervalClock(self.device)
        self.waits.active = False
        for comm in (self.comm, self.replica_comm):
            if comm is not None:
                comm.clock = self.waits
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self.prefetch_depth, self.piece_numel = prefetch_depth, piece_numel
        units, norms = list(model.units()), list(model.norm_modules())
        self.n_units = len(units)
        self.reads_weights = [backward_reads_weights(unit) for unit in units]

        self.layouts, self.small, self.n_norm_slots = plan_layouts(
            model, units, norms, self.shard_size
        )
        # A tied unit (layout.borrows) uses its home unit's shard, gradient and state.
        self.home = [i if lay.owns else lay.borrows for i, lay in enumerate(self.layouts)]
        self.owned = [i for i, home in enumerate(self.home) if home == i]
        # Units gathered in float8 (float8.py); one process computes from its shard instead.
        self.float8 = None
        if float8 is not None and not self.direct:
            self.float8 = Float8Gathers(float8, self.layouts, self.rank, self.device)
        self.gathered_bytes = [0] * self.n_units  # sent in each unit's gathers (benchmarks)
        self.plan = self.buffer_plan()
        self._materialize(units, norms, init)
        self._allocate_buffers()
        self._reset_step_state()
        self._grad_scale: float | None = None  # averaging left for clip_grad_norm_
        self._norms = torch.empty(len(self.owned) + 1, device=self.device)  # per-shard norms
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
        ``group`` (full sharding over it) or ``mesh`` (2-D: replicas x shard group, see
        groups.py), ``force_process_group`` (use the process group's collectives and the
        buffers even with one rank, as with many: how one GPU tests the real path),
        ``piece_numel`` (elements per rank of one reduce-scatter piece, ``sizes.py``),
        ``float8`` (gather the weights it names in float8, ``float8.py``)."""
        return cls(model, init or InitHooks.from_seed(model, seed), device=device, **options)

    def buffer_plan(self) -> EngineBuffers:
        """What this engine preallocates (``sizes.engine_buffers`` over its layouts)."""
        return engine_buffers(
            [layout.numel for layout in self.layouts],
            [layout.single_tensor for layout in self.layouts],
            self.small.numel,
            world_size=self.shard_size,
            param_dtype=self.param_dtype,
            reduce_dtype=self.reduce_dtype,
            prefetch_depth=self.prefetch_depth,
            direct=self.direct,
            piece_numel=self.piece_numel,
            fp8_units=[self.gathers_fp8(i) for i in range(self.n_units)],
        )

    def gathers_fp8(self, unit: int) -> bool:
        """Is ``unit`` gathered in float8?"""
        return self.float8 is not None and self.float8.gathers(unit)

    # ------------------------------------------------------------------ construction
    def _materialize(self, units, norms, init: InitHooks) -> None:
        """Each rank's fp32 master shards, built one unit at a time (see materialize.py)."""
        self.master, self.small_master, self.unit_offsets = materialize_shards(
            self.layouts, self.small, self.n_norm_slots, units, norms,
            init_unit=init.unit, init_norms=init.norms, device=self.device, rank=self.rank,
        )  # fmt: skip
        self.unit_master = self._unit_views(self.master)
        # Parameters the optimizer sees: each unit's shard (a view of the flat master, with
        # weight decay) and the small group's (without). Each unit's fp32 gradient shard is
        # its own tensor, so it exists only once the unit has been reduced in a step.
        self.unit_params = [nn.Parameter(view) for view in self.unit_master]
        self.unit_params = [self.unit_params[home] for home in self.home]  # tied: one
        self.small_param = nn.Parameter(self.small_master)
        self.small_param.grad = torch.zeros_like(self.small_master)
        # One process in bf16: the model computes from a bf16 copy of the whole shard.
        self.compute = self.small_compute = None
        if self.direct and self.param_dtype != torch.float32:
            self.compute = self.master.to(self.param_dtype)
            self.small_compute = self.small_master.to(self.param_dtype)

    def _unit_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each unit's shard inside a tensor laid out like the flat master."""
        return [
            flat.narrow(0, off, lay.shard_numel)
            for off, lay in zip(self.unit_offsets, self.layouts, strict=True)
        ]

    def _allocate_buffers(self) -> None:
        """Exactly what ``self.plan`` says; at world size 1 without a process group every
        unit computes straight from its shard (or its bf16 copy)."""
        plan, dev = self.plan, self.device
        single = [layout.single_tensor for layout in self.layouts]
        self.slot_of = grad_slots(single, plan, dev)
        self.reducer: PieceReducer | None = None
        if self.direct:
            source = self.unit_master if self.compute is None else self._unit_views(self.compute)
            self.buffer_of = [Buffer(view, owner=i, fixed=True) for i, view in enumerate(source)]
            self.small_buffer = self.small_master if self.compute is None else self.small_compute
        else:
            self.buffer_of = gather_buffers(self.n_units, plan, dev)
            self.small_buffer = plan.small_gather.empty(dev)
            self.reducer = self._make_reducer()
        # The small group's gradient accumulates over micro-batches in the parameter dtype
        # (in place in its fp32 shard when that is what it is) and is reduced once.
        spec = plan.small_grad
        self.small_grad = spec.empty(dev).zero_() if spec.count else self.small_param.grad
        self.small_out = plan.small_out.empty(dev) if plan.small_out.count else None

    def _make_reducer(self) -> PieceReducer:
        """The reduce-scatter pieces' staging and output buffers, and who issues them."""
        plan, dev = self.plan, self.device
        buffers = plan.staging.empty(dev), plan.reduce_out.empty(dev), plan.piece_numel
        if isinstance(self.comm, CudaStreamCommunicator):
            return StreamReducer(self.comm, *buffers)
        reducer = ThreadReducer(self.comm.second_group(), *buffers)  # gloo: see reduce.py
        reducer.clock = self.waits  # the helper thread's own waits are not exposed
        return reducer

    def _grad_shard(self, unit: int) -> torch.Tensor:
        """Unit ``unit``'s fp32 gradient shard, allocated (not zeroed) at the unit's first
        reduction in a step, which writes all of it; freed by ``after_step``."""
        param = self.unit_params[unit]
        if param.grad is None:
            param.grad = torch.empty_like(param)
        return param.grad

    # ------------------------------------------------------------------ the step
    def reduce_gradients(self) -> None:
        """Finish every reduction of this step. The averaging over ranks and micro-batches
        is left to ``clip_grad_norm_``, which does it in the same pass as the clipping:
        call it (``max_norm=0`` to only average) before ``optimizer.step()``."""
        for index, state in enumerate(self.state):
            if state != "done" and self.leaves[index]:
                names = [s.name for s in self.layouts[index].slots]
                raise RuntimeError(f"unit {index} ({names[0]}, ...) received no gradient")
        if self.reducer is not None:
            self.reducer.drain()
        for param in self.unit_params:  # no backward at all this step
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        self._reduce_small()
        self._reduce_replicas()
        self._grad_scale = 1.0 / (self.world_size * max(self.micro_batches, 1))

    def after_step(self) -> None:
        """Free the gradient shard, refresh a bf16 copy of the weights, mark buffers stale."""
        if self._grad_scale is not None:
            raise RuntimeError(
                "reduce_gradients() leaves the averaging to clip_grad_norm_(), which was not "
                "called before this step (call it with max_norm=0 to only average)"
            )
        if self.compute is not None:
            self.compute.copy_(self.master)
            self.small_compute.copy_(self.small_master)
        for param in self.unit_params:
            param.grad = None
        if self.float8 is not None:
            self.float8.fresh = False  # new masters: new scales before the next gather
        self.small_grad.zero_()
        if self.small_grad is not self.small_param.grad:
            self.small_param.grad.zero_()
        for buf in self.buffer_of:
            if not buf.fixed:
                buf.owner = None
        for slot in self.slot_of:
            if slot is not None:
                slot.job = None  # landed; it would keep the gradient shard alive
        self._reset_step_state()

    def param_groups(self, weight_decay: float) -> list[dict]:
        """Each unit's shard (decayed) and the small group's (norms, biases): one fused AdamW
        call over a handful of tensors."""
        return [
            {"params": self.owned_params, "weight_decay": weight_decay},
            {"params": [self.small_param], "weight_decay": 0.0},
        ]

    @property
    def owned_params(self) -> list[nn.Parameter]:
        """Each unit's shard once (a tied unit's is its home's)."""
        return [self.unit_params[i] for i in self.owned]

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
        params = [*self.owned_params, self.small_param]
        groups = {"model": params}
        if optimizer is not None:
            first = optimizer.state[params[0]]
            for name, value in first.items():
                if torch.is_tensor(value) and value.shape == params[0].shape:
                    groups[name] = [optimizer.state[p][name] for p in params]
        layouts = [*(self.layouts[i] for i in self.owned), self.small]
        return {
            group: shard_views(self.state_layout, layouts, self.rank, pieces)
            for group, pieces in groups.items()
        }

    def progress(self) -> dict:
        """Where this rank is in its step (read by a hang report, from another thread):
        phase, unit, micro-batch, the collectives it has entered and what it waits on."""
        comms = [self.comm, self.replica_comm]
        if self.reducer is not None and self.reducer.comm is not self.comm:
            comms.append(self.reducer.comm)
        blocked = self.waits.blocked
        return {
            "phase": self.phase,
            "unit": self.unit,
            "micro_batch": self.micro_batches,
            "collectives": sum(c.entered for c in comms if c is not None),
            "waiting_on": blocked,
            "waiting_s": time.monotonic() - self.waits.blocked_since if blocked else None,
        }

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank sent in the engine's collectives (ring accounting, comm.py)."""
        return self.bytes_sent_intra + self.bytes_sent_cross

    @property
    def bytes_sent_intra(self) -> int:
        """Sent within the shard group: gathers, reduce-scatters, the norm's all-reduce."""
        reducer = self.reducer
        extra = reducer.comm.bytes_sent if reducer and reducer.comm is not self.comm else 0
        return self.comm.bytes_sent + extra

    @property
    def bytes_sent_cross(self) -> int:
        """Sent across shard groups: the replicas' gradient all-reduce (0 without HSDP)."""
        return self.replica_comm.bytes_sent if self.replica_comm else 0

    # ------------------------------------------------------------------ full weights
    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter in fp32 on CPU, gathered one unit at a time (tests and export)."""
        result = {}
        pairs = [(self.layouts[i], self.unit_master[i]) for i in self.owned]
        for layout, shard in [*pairs, (self.small, self.small_master)]:
            full = torch.empty(layout.padded_numel, dtype=torch.float32, device=self.device)
            self.comm.wait(self.comm.all_gather(full, shard))
            for slot, view in zip(layout.slots, layout.views(full), strict=True):
                result[slot.name] = view.detach().cpu().clone()
        return result
