"""Per-GPU memory of a training step with this engine, and how many layers to checkpoint.

Nothing here allocates. The model mirrors what the code keeps alive, so it can be checked
against a live-tensor count (tests do):

- resident state (``engine_state_bytes``): the fp32 master shards and AdamW's two moments
  (a Muon run: one momentum for the decoder's matrices, ``plan/muon.py``),
  and the engine's preallocated buffers exactly as the engine sizes them: the planner calls
  ``sharding.sizes.engine_buffers`` over the layouts of a meta-device model. With one process
  in bf16 the model computes from a bf16 copy of the whole shard;
- each unit's fp32 gradient shard, which exists from the unit's first reduction in a step to
  the optimizer step: counted at each moment for the units reduced by then (all of them
  through a later micro-batch of several);
- activations (``activations.ActivationSizes``): what autograd saves per decoder layer in
  this Llama (fp32 RMSNorm inputs, the fused-attention inputs/outputs and log-sum-exp, four
  SwiGLU tensors; less for a compiled layer, ``train.compile``); a checkpointed layer keeps
  only its input;
- the loss: the output head fused with the cross-entropy computes one chunk of tokens at a
  time (``train.loss_chunk_tokens``): one chunk's logits in fp32 (and in the parameter dtype
  while it is cast), the gradient of the hidden states, and the head's weight gradient,
  which lives from the head's forward until its reduction has read it;
- the step's peak is the largest of its moments: the loss, the backward of each layer (or
  the recompute of each checkpointed one: earlier layers hold less activation but more
  reduced gradients), and the gradient norm;
- a runtime allowance for what is not a tensor: CUDA context and workspaces, NCCL buffers,
  allocator fragmentation.

The attention term assumes a fused kernel (flash / memory-efficient on GPU, the CPU flash
kernel here) that never materialises the T x T score matrix.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from yatrain.common import DTYPES, GIB, dtype_bytes
from yatrain.models.llama import flops_per_token, layer_matmul_weights
from yatrain.plan.activations import ActivationSizes, GradientShards, activation_peak
from yatrain.plan.layout import fp8_units, planned_group, unit_layouts
from yatrain.plan.muon import muon_shard_numel, muon_step_bytes
from yatrain.recipe.config import ModelConfig, Recipe
from yatrain.sharding.sizes import EngineBuffers, engine_buffers, staging_budget

CONTEXT_BYTES = 1 * GIB  # CUDA context, cuBLAS/cuDNN workspaces
COMM_BYTES = 1 * GIB  # NCCL channel buffers and the communication stream's scratch
FRAGMENTATION = 0.05  # of device memory: caching-allocator rounding and fragmentation


def default_runtime_allowance(gpu_memory_bytes: float) -> int:
    """What a GPU process needs beyond its tensors: context + NCCL + 5% of device memory."""
    return int(CONTEXT_BYTES + COMM_BYTES + FRAGMENTATION * gpu_memory_bytes)


# ----------------------------------------------------------------------------- the engine


def engine_layout(
    m: ModelConfig,
    world: int,
    dtype: str,
    reduce_dtype: str,
    prefetch_depth: int,
    direct: bool | None = None,
    float8: str | None = None,
    staging_bytes: int | None = None,
) -> tuple[int, int, EngineBuffers]:
    """(elements of this rank's shard of every unit, of the norm group, the buffers the
    engine preallocates), from the same functions the engine uses. ``staging_bytes``: the
    reduce-scatter staging budget (None: ``auto`` with no device memory known)."""
    layouts, small = unit_layouts(m, world)
    direct = world == 1 if direct is None else direct
    buffers = engine_buffers(
        [layout.numel for layout in layouts],
        [layout.single_tensor for layout in layouts],
        small.numel,
        world_size=world,
        param_dtype=DTYPES[dtype],
        reduce_dtype=DTYPES[reduce_dtype],
        prefetch_depth=prefetch_depth,
        direct=direct,
        staging_bytes=staging_budget(None, None) if staging_bytes is None else staging_bytes,
        fp8_units=fp8_units(m, float8, direct),
    )
    owned = sum(layout.shard_numel for layout in layouts if layout.owns)  # tied: once
    return owned, small.shard_numel, buffers


def engine_state_bytes(
    m: ModelConfig,
    world: int,
    dtype: str,
    reduce_dtype: str,
    prefetch_depth: int,
    direct: bool | None = None,
    float8: str | None = None,
    staging_bytes: int | None = None,
) -> dict[str, int]:
    """Bytes per rank of every tensor the engine and AdamW keep for the whole run (the
    fp32 gradient shards, which they do not, are ``GradientShards``)."""
    layout = engine_layout(
        m, world, dtype, reduce_dtype, prefetch_depth, direct, float8, staging_bytes
    )
    return state_bytes(*layout, dtype)


def state_bytes(
    units: int, small: int, buffers: EngineBuffers, dtype: str, muon: int = 0
) -> dict[str, int]:
    """``engine_state_bytes`` from an ``engine_layout`` already made; ``muon``: the elements
    of this rank's shards Muon updates (one fp32 momentum instead of AdamW's two moments)."""
    shards = units + small
    copy = buffers.gather.count == 0 and dtype != "fp32"  # one process, bf16
    return {
        "master_weights": 4 * shards,
        "optimizer_state": 8 * shards - 4 * muon,
        "compute_copy": dtype_bytes(dtype) * shards if copy else 0,
        "gather_buffers": buffers.gather_bytes(),
        # (+ the norm group's fp32 gradient shard, which stays allocated)
        "gradient_buffers": buffers.gradient_bytes() + 4 * small,
    }


def recompute_fraction(m: ModelConfig, seq_len: int, checkpointed: int) -> float:
    """Extra FLOPs of recomputing the checkpointed layers' forward, as a share of the step's
    useful FLOPs (``flops_per_token``): each layer forward is 2 x weights + 4 x seq x dim."""
    layer_forward = 2 * layer_matmul_weights(m) + 4 * seq_len * m.n_heads * m.head_dim
    return checkpointed * layer_forward / flops_per_token(m, seq_len)


# ----------------------------------------------------------------------------- the plan


@dataclass
class MemoryPlan:
    """The planner's answer for one recipe on ``world_size`` GPUs (all sizes in bytes)."""

    world_size: int
    n_layers: int
    seq_len: int
    micro_batch_size: int
    global_batch_size: int
    dtype: str
    gpu_memory_bytes: int | None
    runtime_allowance_bytes: int
    activation_checkpoint_layers: int
    peak_bytes_per_gpu: int  # tensor peak + runtime allowance
    tensor_peak_bytes: int  # what an allocator's max_memory_allocated would show
    peak_moment: str
    fits: bool | None  # None: no memory limit to compare with
    recompute_flops_fraction: float
    breakdown: dict[str, int]
    full_layer_bytes: int
    checkpointed_layer_bytes: int
    min_gpus: int | None = None  # when nothing fits: the smallest GPU count (group) that does
    context_parallel: int = 1  # ranks sharing each window (sharding.context_parallel)
    # when nothing fits: the smallest CP size that does on these GPUs, and the checkpointed
    # layers it needs ({"context_parallel": c, "activation_checkpoint_layers": k})
    min_context_parallel: dict | None = None
    recipe_setting: dict = field(default_factory=dict)
    shard_group_size: int = 0  # the state is sharded over this many GPUs (HSDP: < world)
    # The reduce-scatter staging: its budget, what it holds, each unit's pieces (sizes.py).
    staging: dict = field(default_factory=dict)
    traffic: dict = field(default_factory=dict)  # per-step bytes per GPU (traffic.py)
    # A Muon step's updates, exchange and Newton-Schulz workspace (plan/muon.py), at the
    # optimizer step after the backward, whether or not that is the peak; 0 for AdamW.
    optimizer_step_bytes: int = 0

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    def batch_for_min_gpus(self) -> int | None:
        """The multiple the global batch must become for ``min_gpus`` GPUs to split it (a
        count that fits always takes it where one can: ``min_gpus_to_fit``); None when the
        recipe's already splits, or when ``min_gpus`` is a shard group, not a world."""
        if not self.min_gpus or self.shard_group_size < self.world_size:
            return None
        per_step = self.micro_batch_size * (self.min_gpus // self.context_parallel)
        return per_step if self.global_batch_size % per_step else None


def activation_sizes(recipe: Recipe) -> ActivationSizes:
    """A micro-batch's activations on one rank of this recipe (``activations.py``)."""
    data = recipe.data
    return ActivationSizes.of(
        recipe.model,
        data.seq_len,
        data.micro_batch_size,
        recipe.train.dtype,
        recipe.train.loss_chunk_tokens,
        compiled=recipe.train.compile,
        context_parallel=recipe.sharding.context_parallel,
        document_mask=data.document_mask,
    )


def _masks(acts: ActivationSizes) -> dict[str, int]:
    return {"attention_masks": acts.mask} if acts.mask else {}


def plan_for_layers(
    recipe: Recipe,
    world_size: int,
    checkpointed: int,
    gpu_memory_bytes: int | None = None,
    runtime_allowance_bytes: int | None = None,
    device_memory_bytes: int | None = None,
    *,
    shard_group: int | None = None,
) -> MemoryPlan:
    """Peak memory per GPU with the first ``checkpointed`` decoder layers checkpointed.
    ``device_memory_bytes``: what ``auto`` staging is a share of, if not ``gpu_memory_bytes``
    (a CPU's RAM); ``shard_group``: a run's resolved one (``planned_group``)."""
    m, s, data, dtype = recipe.model, recipe.sharding, recipe.data, recipe.train.dtype
    if runtime_allowance_bytes is None:
        runtime_allowance_bytes = default_runtime_allowance(gpu_memory_bytes or 0)
    group = planned_group(recipe, world_size, shard_group)  # the state is sharded over it
    direct = group == 1 and not s.force_process_group
    budget = staging_budget(s.reduce_staging_mib, device_memory_bytes or gpu_memory_bytes)
    layout = engine_layout(
        m, group, dtype, s.reduce_dtype, s.prefetch_depth, direct, recipe.train.float8, budget
    )
    muon = muon_shard_numel(m, group) if recipe.optim.name == "muon" else 0
    state, buffers = state_bytes(*layout, dtype, muon), layout[2]
    cp = s.context_parallel
    acts = activation_sizes(recipe)
    accumulating = data.global_batch_size > data.micro_batch_size * world_size // cp
    # clip_grad_norm_ reduces with vector_norm: no scratch the size of the gradient shard.
    optimizer = muon_step_bytes(recipe, world_size, group)
    grads = GradientShards.of(m, group)
    moment, parts = activation_peak(
        acts, m.n_layers, checkpointed, grads, accumulating, direct, optimizer=optimizer
    )
    breakdown = {**state, "batch_and_rope": acts.batch, **_masks(acts), **parts}
    tensor_peak = sum(breakdown.values())
    breakdown["runtime_allowance"] = runtime_allowance_bytes
    peak = tensor_peak + runtime_allowance_bytes
    return MemoryPlan(
        world_size=world_size,
        n_layers=m.n_layers,
        seq_len=recipe.data.seq_len,
        micro_batch_size=recipe.data.micro_batch_size,
        global_batch_size=recipe.data.global_batch_size,
        dtype=dtype,
        gpu_memory_bytes=gpu_memory_bytes,
        runtime_allowance_bytes=runtime_allowance_bytes,
        activation_checkpoint_layers=checkpointed,
        peak_bytes_per_gpu=peak,
        tensor_peak_bytes=tensor_peak,
        peak_moment=moment,
        fits=None if gpu_memory_bytes is None else peak <= gpu_memory_bytes,
        recompute_flops_fraction=recompute_fraction(m, recipe.data.seq_len, checkpointed),
        breakdown=breakdown,
        full_layer_bytes=acts.full_layer,
        checkpointed_layer_bytes=acts.checkpointed_layer,
        shard_group_size=group,
        context_parallel=cp,
        staging={"budget": budget, "bytes": buffers.staging.bytes, "pieces": buffers.pieces},
        optimizer_step_bytes=optimizer,
    )
