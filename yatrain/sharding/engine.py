"""The sharded data-parallel engine: flat fp32 master shards, reused buffers, overlapped comms.

The model is described as an ordered list of units (embedding, decoder layers, output head)
plus its norm modules (``contract.ShardableModel``). Each unit's weights are flattened and
sharded across ranks (``shards.py``, built by ``materialize.py``); during a unit's forward
and backward its parameters are views into a preallocated gather buffer (sized by
``sizes.engine_buffers``, allocated once in ``buffers.py``, never freed) and its gradient is
reduce-scattered in pieces into the unit's fp32 gradient shard (``reduce.py``). Norm weights
(and any other 1-D parameter) form one small group gathered once and reduced once per step.

``ShardedEngine`` composes the parts, each given what it uses: ``StepState``
(``step_state.py``) is where the step stands, reset by ``after_step``; ``UnitHooks``
(``hooks.py``) follows the forward and backward unit by unit, gathering through
``UnitGathers`` (``gathers.py``) and routing each arriving gradient through
``GradientArrival`` (``arrival.py``); ``GradientFinish`` (``gradients.py``) ends the step's
gradients. The saved state is described in ``state.py``.

The fp32 gradient shard exists only from a step's first reduction to its ``after_step``:
the first micro-batch's reductions write it (nothing is zeroed), later ones add to it, and
no forward that does not need it holds it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from yatrain.sharding.arrival import GradientArrival
from yatrain.sharding.buffers import WorkBuffers
from yatrain.sharding.comm import Communicator, merge_traffic
from yatrain.sharding.contract import InitHooks, ShardableModel, backward_reads_weights
from yatrain.sharding.float8 import Float8Format, Float8Gathers
from yatrain.sharding.gathers import UnitGathers
from yatrain.sharding.gradients import GradientFinish
from yatrain.sharding.groups import communicators
from yatrain.sharding.hooks import UnitHooks
from yatrain.sharding.layout import MatrixMap, plan_layouts
from yatrain.sharding.shards import MasterShards
from yatrain.sharding.sizes import EngineBuffers, device_memory, engine_buffers, staging_budget
from yatrain.sharding.state import (
    ShardView,
    StateEntry,
    gather_full,
    sharded_views,
    state_entries,
)
from yatrain.sharding.step_state import Phase, StepState
from yatrain.sharding.timing import IntervalClock


class ShardedEngine:
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
        staging_bytes: int | None = None,
        float8: Float8Format | None = None,
        cuda_path: bool = False,
    ) -> None:
        if prefetch_depth < 1:
            raise ValueError("prefetch_depth must be at least 1")
        self.device = torch.device(device)
        self.mesh = mesh  # a checkpoint is sharded over it too (groups.py)
        self.comm, self.replica_comm = communicators(
            group, mesh, self.device, force_group=force_process_group, cuda_path=cuda_path
        )
        # shard_size ranks share each unit; world_size ranks (replicas x shard group) train.
        self.shard_size, self.rank = self.comm.world_size, self.comm.rank
        self.replicas = self.replica_comm.world_size if self.replica_comm else 1
        self.world_size = self.shard_size * self.replicas
        self.direct = type(self.comm) is Communicator  # one process, no group: no buffers
        self.waits = self._wait_clock()
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self.prefetch_depth = prefetch_depth
        if staging_bytes is None:  # auto: the same rule the planner applies (sizes.py)
            staging_bytes = staging_budget(None, device_memory(self.device))
        self.staging_bytes = staging_bytes
        units, norms = list(model.units()), list(model.norm_modules())
        self.n_units = len(units)
        self.reads_weights = [backward_reads_weights(unit) for unit in units]
        self.layouts, self.small, self.n_norm_slots = plan_layouts(
            model, units, norms, self.shard_size
        )
        # Units gathered in float8 (float8.py); one process computes from its shard instead.
        self.float8 = None
        if float8 is not None and not self.direct:
            self.float8 = Float8Gathers(float8, self.layouts, self.rank, self.device)
        self.plan = self.buffer_plan()
        self._allocate(units, norms, init)
        self.step_state = StepState(self.n_units)
        self._compose(units)
        self.gathered_bytes = self.gathers.gathered_bytes  # sent in each unit's gathers

    def _allocate(self, units: list[nn.Module], norms: list[nn.Module], init: InitHooks) -> None:
        """This rank's master shards (filled by ``init``) and the buffers ``self.plan``
        names."""
        bf16_copy = self.direct and self.param_dtype != torch.float32  # one process uses it
        self.shards = MasterShards.build(
            self.layouts,
            self.small,
            self.n_norm_slots,
            units,
            norms,
            init,
            device=self.device,
            rank=self.rank,
            compute_dtype=self.param_dtype if bf16_copy else None,
        )
        # A tied unit (layout.borrows) uses its home unit's shard, gradient and state.
        self.home, self.owned = self.shards.home, self.shards.owned
        self.buffers = WorkBuffers.allocate(
            self.plan,
            self.shards,
            self.comm,
            direct=self.direct,
            device=self.device,
            clock=self.waits,
        )

    def _wait_clock(self) -> IntervalClock:
        """Exposed communication: the waits on gathers and reductions (timing.py), timed
        while a caller turns it on (train_step does, around its step)."""
        waits = IntervalClock(self.device)
        waits.active = False
        for comm in (self.comm, self.replica_comm):
            if comm is not None:
                comm.clock = waits
        return waits

    def _compose(self, units: list[nn.Module]) -> None:
        """The gathers, the gradient routing, the hooks and the step's end, over this
        engine's state and buffers."""
        self.gathers = UnitGathers(
            self.comm,
            self.layouts,
            self.shards.unit_master,
            self.buffers.buffer_of,
            reads_weights=self.reads_weights,
            prefetch_depth=self.prefetch_depth,
            float8=self.float8,
        )
        arrival = GradientArrival(
            self.step_state, self.shards, self.buffers, self.replica_comm, direct=self.direct
        )
        self.hooks = UnitHooks(
            self.step_state,
            self.gathers,
            arrival,
            self.buffers,
            self.shards,
            self.comm,
            self.small,
            param_dtype=self.param_dtype,
            direct=self.direct,
        )
        self.hooks.register(units)
        self.finish = GradientFinish(
            self.step_state,
            self.shards,
            self.buffers,
            self.comm,
            self.replica_comm,
            world_size=self.world_size,
            reduce_dtype=self.reduce_dtype,
            direct=self.direct,
        )

    @classmethod
    def from_model(
        cls,
        model: ShardableModel,
        *,
        device: torch.device | str,
        seed: int = 0,
        init: InitHooks | None = None,
        **options: Any,
    ) -> ShardedEngine:
        """Shard a meta-device ``model``: each rank materialises one unit at a time, fills
        it (``init``, default: the model's own initialisation from ``seed``) and keeps only
        its shard. ``options``: ``param_dtype``, ``reduce_dtype``, ``prefetch_depth``,
        ``group`` (full sharding over it) or ``mesh`` (2-D: replicas x shard group, see
        groups.py), ``force_process_group`` (use the process group's collectives and the
        buffers even with one rank, as with many: how one GPU tests the real path),
        ``staging_bytes`` (the reduce-scatter staging budget; None: ``auto``, ``sizes.py``),
        ``float8`` (gather the weights it names in float8, ``float8.py``), ``cuda_path`` (the
        CUDA path on a CPU device, over fake streams: a dry run's choice, groups.py)."""
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
            staging_bytes=self.staging_bytes,
            fp8_units=[self.gathers_fp8(i) for i in range(self.n_units)],
        )

    def gathers_fp8(self, unit: int) -> bool:
        """Is ``unit`` gathered in float8?"""
        return self.float8 is not None and self.float8.gathers(unit)

    # ------------------------------------------------------------------ the step
    def reduce_gradients(self) -> None:
        """Finish every reduction of this step. The averaging over ranks and micro-batches
        is left to ``clip_grad_norm_``, which does it in the same pass as the clipping:
        call it (``max_norm=0`` to only average) before ``optimizer.step()``."""
        self.finish.reduce_gradients()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Average the gradients (see ``reduce_gradients``) and return their exact global L2
        norm across all shards (one all-reduce); clip to ``max_norm`` when it is > 0."""
        return self.finish.clip_grad_norm_(max_norm)

    def expect_micro_batches(self, count: int) -> None:
        """This step runs ``count`` micro-batches: under hybrid sharding the last one's
        reductions start the replicas' all-reduce as each lands, overlapping the rest of the
        backward. Optional: without it the all-reduce waits for ``reduce_gradients``."""
        self.step_state.expected_micro_batches = count

    def after_step(self) -> None:
        """Free the gradient shard, refresh a bf16 copy of the weights, mark buffers stale."""
        if self.step_state.grad_scale is not None:
            raise RuntimeError(
                "reduce_gradients() leaves the averaging to clip_grad_norm_(), which was not "
                "called before this step (call it with max_norm=0 to only average)"
            )
        self.shards.after_step()
        if self.float8 is not None:
            self.float8.fresh = False  # new masters: new scales before the next gather
        self.buffers.after_step(self.shards.small_grad)
        self.step_state.reset()

    def param_groups(self, weight_decay: float) -> list[dict[str, Any]]:
        """Each unit's shard (decayed) and the small group's (norms, biases): one fused AdamW
        call over a handful of tensors."""
        return [
            {"params": self.owned_params, "weight_decay": weight_decay},
            {"params": [self.shards.small_param], "weight_decay": 0.0},
        ]

    def unit_groups(self, weight_decay: float) -> list[dict[str, Any]]:
        """Per owned unit (``unit``: its index) and the small group's (None): for Muon."""
        groups: list[tuple[list[nn.Parameter], float, int | None]]
        groups = [([self.shards.unit_params[i]], weight_decay, i) for i in self.owned]
        groups.append(([self.shards.small_param], 0.0, None))
        return [{"params": p, "weight_decay": wd, "unit": unit} for p, wd, unit in groups]

    def matrix_map(self, unit: int) -> MatrixMap:
        """Which flat range of which matrix of ``unit`` each rank of the shard group holds."""
        return MatrixMap.of(self.layouts[unit], self.shard_size)

    # ------------------------------------------------------------------ where the step is
    @property
    def owned_params(self) -> list[nn.Parameter]:
        """Each unit's shard once (a tied unit's is its home's)."""
        return self.shards.owned_params

    @property
    def phase(self) -> Phase:
        """idle, forward or backward (``StepState.phase``)."""
        return self.step_state.phase

    # ------------------------------------------------------------------ saved state
    @property
    def state_layout(self) -> list[StateEntry]:
        """The flat tensors a checkpoint of this engine holds (what one must match)."""
        return state_entries(self.layouts, self.small)

    def sharded_state(
        self, optimizer: torch.optim.Optimizer | None = None
    ) -> dict[str, dict[str, ShardView]]:
        """This rank's piece of every flat tensor, with its global offset: ``"model"`` (fp32
        masters) and each state tensor shaped like the weights, over the entries that have it
        (AdamW: ``exp_avg``, ``exp_avg_sq``; Muon: ``momentum_buffer``). Views, no copies."""
        params: list[torch.Tensor] = [*self.owned_params, self.shards.small_param]
        layouts = [*(self.layouts[i] for i in self.owned), self.small]
        states = [optimizer.state[p] if optimizer else {} for p in params]
        return sharded_views(self.state_layout, layouts, self.rank, params, states)

    def progress(self) -> dict[str, Any]:
        """Where this rank is in its step, for a hang report (``StepState.progress``)."""
        entered = sum(c.entered for c in [*self._group_comms(), self.replica_comm] if c)
        return self.step_state.progress(self.phase, self.waits, entered)

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank sent in the engine's collectives (ring accounting, comm.py)."""
        return self.bytes_sent_intra + self.bytes_sent_cross

    @property
    def bytes_sent_intra(self) -> int:
        """Sent within the shard group: gathers, reduce-scatters, the norm's all-reduce."""
        return sum(comm.bytes_sent for comm in self._group_comms())

    def traffic(self) -> dict[str, tuple[int, int]]:
        """The engine's collectives by kind, ``(count, bytes sent)``, within the shard group
        and across the replicas."""
        return merge_traffic([*self._group_comms(), self.replica_comm])

    def _group_comms(self) -> list[Communicator]:
        """The shard group's communicators: the engine's, and its reducer's own if it has one."""
        reducer = self.buffers.reducer
        if reducer is None or reducer.comm is self.comm:
            return [self.comm]
        return [self.comm, reducer.comm]

    @property
    def bytes_sent_cross(self) -> int:
        """Sent across shard groups: the replicas' gradient all-reduce (0 without HSDP)."""
        return self.replica_comm.bytes_sent if self.replica_comm else 0

    # ------------------------------------------------------------------ full weights
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter in fp32 on CPU, gathered one unit at a time (tests and export)."""
        pairs = [(self.layouts[i], self.shards.unit_master[i]) for i in self.owned]
        return gather_full(self.comm, [*pairs, (self.small, self.shards.small_master)])
