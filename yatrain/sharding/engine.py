"""The sharded data-parallel engine: flat fp32 master shards, reused buffers, overlapped comms.

The model is described as an ordered list of units (embedding, decoder layers, output head)
plus its norm modules. Each unit's weights are flattened and sharded across ranks; during a
unit's forward and backward its parameters are views into a preallocated gather buffer and
its gradient lands as one flat tensor in a preallocated gradient buffer. Norm weights (and
any other 1-D parameter) form one small group gathered once and reduced once per step.

Buffers (allocated once, never freed):
- ``prefetch_depth + 1`` inner gather buffers and 2 inner gradient buffers, sized to the
  largest inner unit (a decoder layer); consecutive layers rotate through them;
- one edge gather buffer and one edge gradient buffer for the first and last unit
  (embedding, output head), so a large vocabulary does not inflate the layer buffers;
- the small group's gather and gradient buffers, an fp32 staging buffer per kind when
  gradients are bf16 but the reduction is fp32, and one reduce-scatter output per slot.

Ordering: the only rule is that a buffer is overwritten when its previous user is done with
it. In forward that is any unit other than the one computing; in backward, units whose
backward has finished. Units still resident from the forward (the last layers and the head)
are simply not gathered again; after the optimizer step every buffer is marked stale.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from yatrain.sharding.buffers import Buffer, GradSlot
from yatrain.sharding.comm import Communicator, Handle, make_communicator
from yatrain.sharding.layout import alias, flat_numels, plan_layouts
from yatrain.sharding.materialize import materialize_shards


class _BackwardGate(torch.autograd.Function):
    """Identity whose backward announces "this unit's backward starts now"."""

    @staticmethod
    def forward(ctx, callback: Callable[[], None], tensor: torch.Tensor) -> torch.Tensor:
        ctx.callback = callback
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.callback()
        return None, grad


class ShardedEngine:
    """Owns the model's weights as flat shards and drives gathers and reductions via hooks.

    ``init_unit(i)`` fills unit ``i``'s freshly materialised parameters and ``init_norms()``
    the norm weights; both are called with one unit materialised at a time, so the full
    model never exists anywhere. The caller runs forward/backward as usual, then
    ``reduce_gradients()``, ``clip_grad_norm_()``, ``optimizer.step()`` and ``after_step()``.
    """

    def __init__(
        self,
        model: nn.Module,
        units: Sequence[nn.Module],
        norms: Sequence[nn.Module],
        *,
        init_unit: Callable[[int], None],
        init_norms: Callable[[], None],
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
        self.n_units = len(units)

        self.layouts, self.small, self.n_norm_slots = plan_layouts(
            model, units, norms, self.world_size
        )
        self._materialize(units, norms, init_unit, init_norms)
        self._allocate_buffers()
        self._reset_step_state()
        for index, unit in enumerate(units):
            unit.register_forward_pre_hook(functools.partial(self._pre_forward, index))
            unit.register_forward_hook(functools.partial(self._post_forward, index))

    # ------------------------------------------------------------------ construction
    def _materialize(self, units, norms, init_unit, init_norms) -> None:
        """Each rank's fp32 master shards, built one unit at a time (see materialize.py)."""
        self.master, self.small_master, self.unit_offsets = materialize_shards(
            self.layouts, self.small, self.n_norm_slots, units, norms,
            init_unit=init_unit, init_norms=init_norms, device=self.device, rank=self.rank,
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
        dev, pdt = self.device, self.param_dtype
        last = self.n_units - 1
        edges = sorted({0, last})
        inner = [i for i in range(self.n_units) if i not in edges]
        self.buffer_of: list[Buffer] = [None] * self.n_units  # type: ignore[list-item]
        self.slot_of: list[GradSlot | None] = [None] * self.n_units
        grads_direct = self.direct and pdt == torch.float32
        needs_staging = not self.direct and pdt != self.reduce_dtype
        self._staging: Handle | None = None  # the last reduce-scatter that used staging

        def empty(n: int, dtype=pdt) -> torch.Tensor:
            return torch.zeros(n, dtype=dtype, device=dev)

        def make_slot(n: int, shard: int) -> GradSlot:
            staging = empty(n, self.reduce_dtype) if needs_staging else None
            return GradSlot(empty(n), empty(shard, self.reduce_dtype), staging)

        if self.direct:  # world size 1: every unit computes straight from its own shard
            for i in range(self.n_units):
                self.buffer_of[i] = Buffer(self.unit_compute[i], owner=i, fixed=True)
        else:
            edge_n = max(self.layouts[i].padded_numel for i in edges)
            edge = Buffer(empty(edge_n))
            for i in edges:
                self.buffer_of[i] = edge
            if inner:
                inner_n = max(self.layouts[i].padded_numel for i in inner)
                ring = [Buffer(empty(inner_n)) for _ in range(self.prefetch_depth + 1)]
                for j, i in enumerate(inner):
                    self.buffer_of[i] = ring[j % len(ring)]
        if not grads_direct:
            edge_lay = [self.layouts[i] for i in edges]
            edge_slot = make_slot(
                max(lay.padded_numel for lay in edge_lay), max(lay.shard_numel for lay in edge_lay)
            )
            for i in edges:
                self.slot_of[i] = edge_slot
            if inner:
                n = max(self.layouts[i].padded_numel for i in inner)
                s = max(self.layouts[i].shard_numel for i in inner)
                pair = [make_slot(n, s), make_slot(n, s)]
                if needs_staging:  # one fp32 staging buffer shared by both inner slots
                    pair[1].staging = pair[0].staging
                for j, i in enumerate(inner):
                    self.slot_of[i] = pair[j % 2]

        # The small group (norms): gathered once per step, its gradient reduced once.
        small_n = self.small.padded_numel
        self.small_buffer = self.small_compute if self.direct else empty(small_n)
        self.small_grad = (
            self.small_param.grad if grads_direct else empty(small_n)
        )  # accumulates over micro-batches
        self.small_out = None if self.direct else empty(self.small.shard_numel, self.reduce_dtype)

    # ------------------------------------------------------------------ step state
    def _reset_step_state(self) -> None:
        self.phase = "idle"
        self.state = ["idle"] * self.n_units  # idle | forward | backward | done
        self.leaves: list[list[torch.Tensor]] = [[] for _ in range(self.n_units)]
        self.waiting_grads = [0] * self.n_units
        self.pending: list[Handle] = []
        self.micro_batches = 0
        self.small_ready = False

    def _ensure_small(self) -> None:
        if self.small_ready:
            return
        if not self.direct:
            self.comm.wait(self.comm.all_gather(self.small_buffer, self.small_compute))
        grads = alias(self.small_grad)
        for slot, view, grad in zip(
            self.small.slots,
            self.small.views(alias(self.small_buffer)),
            self.small.views(grads),
            strict=True,
        ):
            view.requires_grad_(True)
            view.grad = grad
            setattr(slot.module, slot.attr, view)
        self.small_ready = True

    # ------------------------------------------------------------------ gathering
    def _gather(self, unit: int) -> None:
        buf = self.buffer_of[unit]
        if buf.owner == unit:
            return
        buf.owner = unit
        size = self.layouts[unit].padded_numel
        buf.handle = self.comm.all_gather(buf.data[:size], self.unit_compute[unit])

    def _ensure_gathered(self, unit: int) -> torch.Tensor:
        self._gather(unit)
        buf = self.buffer_of[unit]
        self.comm.wait(buf.handle)
        return buf.alias

    def _prefetch(self, unit: int, step: int) -> None:
        """Issue the next units' gathers (forward: step=+1, backward: -1) ahead of use."""
        for k in range(1, self.prefetch_depth + 1):
            target = unit + step * k
            if not 0 <= target < self.n_units:
                return
            owner = self.buffer_of[target].owner
            busy = owner == unit if step > 0 else owner is not None and owner <= unit
            if owner != target and busy:
                return  # keep order: never skip one unit to gather a later one
            self._gather(target)

    # ------------------------------------------------------------------ hooks
    def _pre_forward(self, unit: int, module: nn.Module, args) -> None:
        if self.phase == "backward" and self.state[unit] == "backward":
            self._ensure_gathered(unit)  # activation-checkpoint recompute: bindings stay
            return
        if unit == 0:
            self.phase = "forward"
            self.state = ["idle"] * self.n_units
            if torch.is_grad_enabled():
                self.micro_batches += 1
        self._ensure_small()
        flat = self._ensure_gathered(unit)
        track = torch.is_grad_enabled()
        leaves = []
        layout = self.layouts[unit]
        for slot, view in zip(layout.slots, layout.views(flat), strict=True):
            if track:
                view.requires_grad_(True)
                view.register_post_accumulate_grad_hook(self._grad_hook(unit))
            setattr(slot.module, slot.attr, view)
            leaves.append(view)
        self.leaves[unit] = leaves if track else []
        self.state[unit] = "forward"
        self._prefetch(unit, +1)

    def _post_forward(self, unit: int, module: nn.Module, args, output):
        if self.state[unit] != "forward" or not torch.is_tensor(output):
            return None
        if not (torch.is_grad_enabled() and output.requires_grad):
            return None
        return _BackwardGate.apply(functools.partial(self._pre_backward, unit), output)

    def _pre_backward(self, unit: int) -> None:
        if self.state[unit] == "backward":
            return
        self.phase = "backward"
        self.state[unit] = "backward"
        self._ensure_gathered(unit)
        self.waiting_grads[unit] = len(self.leaves[unit])
        slot = self.slot_of[unit]
        if slot is None:  # world size 1 in fp32: accumulate straight into the grad shard
            grads = self.layouts[unit].views(alias(self.unit_grad[unit]))
        else:
            self.comm.wait(slot.handle)  # the previous reduce-scatter has left this buffer
            slot.data[: self.layouts[unit].padded_numel].zero_()
            grads = self.layouts[unit].views(slot.alias)
        for leaf, grad in zip(self.leaves[unit], grads, strict=True):
            leaf.grad = grad
        self._prefetch(unit, -1)

    def _grad_hook(self, unit: int) -> Callable[[torch.Tensor], None]:
        def hook(_: torch.Tensor) -> None:
            self.waiting_grads[unit] -= 1
            if self.waiting_grads[unit] == 0:
                self.state[unit] = "done"
                self._reduce(unit)

        return hook

    def _reduce(self, unit: int) -> None:
        slot = self.slot_of[unit]
        if slot is None:
            return
        layout, shard_grad = self.layouts[unit], self.unit_grad[unit]
        if self.direct:  # bf16 gradients, one process: accumulate into the fp32 shard
            shard_grad.add_(slot.data[: layout.numel])
            return
        full = slot.data[: layout.padded_numel]
        out = slot.out[: layout.shard_numel]
        before = after = None
        if slot.staging is not None:
            staging = slot.staging[: layout.padded_numel]
            before, after, full = functools.partial(staging.copy_, full), self._staging, staging
        handle = self.comm.reduce_scatter(
            out, full, before=before, after=after, then=functools.partial(shard_grad.add_, out)
        )
        if slot.staging is not None:
            self._staging = handle
        slot.handle = handle
        self.pending.append(handle)

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

    def local_pieces(
        self, flat: torch.Tensor, small: torch.Tensor
    ) -> dict[str, tuple[torch.Tensor, int]]:
        """This rank's real (unpadded) elements of each unit, as views of ``flat``/``small``
        (tensors laid out like the master shards), with the unit's global length. Shards
        follow ``torch.chunk`` boundaries, so each view is the local piece of a dim-0
        sharded tensor: what a reshardable checkpoint needs."""
        pieces = {}
        layouts = [*self.layouts, self.small]
        names = [f"unit.{i}" for i in range(self.n_units)] + ["small"]
        views = [*self._unit_views(flat), small]
        for name, layout, view in zip(names, layouts, views, strict=True):
            start, _ = layout.shard_range(self.rank)
            real = max(0, min(layout.shard_numel, layout.numel - start))
            pieces[name] = (view[:real], layout.numel)
        return pieces

    @property
    def unit_numels(self) -> list[int]:
        """Each unit's real length, then the small group's: a checkpoint's shape."""
        return flat_numels(self.layouts, self.small)

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
