"""Per-GPU memory of a training step with this engine, and how many layers to checkpoint.

Everything here is arithmetic on the recipe; nothing is allocated. The model mirrors what the
code actually keeps alive, so it can be checked against a live-tensor count (tests do):

- resident state (``engine_state_bytes``): exactly the tensors ``ShardedEngine`` and AdamW
  allocate: fp32 master shards, their gradients, two AdamW moments, the bf16 gather-input
  copy, and the preallocated gather/gradient/staging/reduce-scatter buffers. At world size 1
  parameters are views of the shard, so there are no gather buffers;
- activations (``activation_bytes``): what autograd saves per decoder layer in this Llama
  (fp32 RMSNorm inputs, the fused-attention inputs/outputs and log-sum-exp, four SwiGLU
  tensors); a checkpointed layer keeps only its input;
- the step's peak is the largest of a few moments: the loss (logits, fp32 log-softmax and
  its gradients), the first backward layer, the recompute of the last checkpointed layer,
  and the gradient-norm scratch after backward;
- a runtime allowance for what is not a tensor: CUDA context and workspaces, NCCL buffers,
  allocator fragmentation.

The attention term assumes a fused kernel (flash / memory-efficient on GPU, the CPU flash
kernel here) that never materialises the T x T score matrix.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from yatrain.common import GIB, dtype_bytes
from yatrain.config import ModelConfig, Recipe
from yatrain.models.llama import flops_per_token

CONTEXT_BYTES = 1 * GIB  # CUDA context, cuBLAS/cuDNN workspaces
COMM_BYTES = 1 * GIB  # NCCL channel buffers and the communication stream's scratch
FRAGMENTATION = 0.05  # of device memory: caching-allocator rounding and fragmentation


def default_runtime_allowance(gpu_memory_bytes: float) -> int:
    """What a GPU process needs beyond its tensors: context + NCCL + 5% of device memory."""
    return int(CONTEXT_BYTES + COMM_BYTES + FRAGMENTATION * gpu_memory_bytes)


# ----------------------------------------------------------------------------- shapes


@dataclass(frozen=True)
class UnitSizes:
    """Element counts of the engine's units: embedding, one decoder layer, head, norm group."""

    embedding: int
    layer: int
    output: int
    small: int

    @classmethod
    def of(cls, m: ModelConfig) -> UnitSizes:
        hd = m.head_dim
        attention = 2 * m.dim * m.n_heads * hd + 2 * m.dim * m.n_kv_heads * hd
        return cls(
            embedding=m.vocab_size * m.dim,
            layer=attention + 3 * m.dim * m.ffn_dim,
            output=m.vocab_size * m.dim,
            small=(2 * m.n_layers + 1) * m.dim,
        )


def _padded(n: int, world: int) -> int:
    return math.ceil(n / world) * world


def _shard(n: int, world: int) -> int:
    return _padded(n, world) // world


def engine_state_bytes(
    m: ModelConfig, world: int, dtype: str, reduce_dtype: str, prefetch_depth: int
) -> dict[str, int]:
    """Bytes per rank of every tensor the engine and AdamW keep for the whole run."""
    u, p, r = UnitSizes.of(m), dtype_bytes(dtype), dtype_bytes(reduce_dtype)
    shards = 2 * _shard(u.embedding, world) + m.n_layers * _shard(u.layer, world)
    shards += _shard(u.small, world)  # (embedding and output have equal sizes)
    direct = world == 1
    edge_padded = _padded(u.embedding, world)
    layer_padded, small_padded = _padded(u.layer, world), _padded(u.small, world)
    edge_shard, layer_shard = _shard(u.embedding, world), _shard(u.layer, world)

    gather = 0
    if not direct:
        gather = (edge_padded + (prefetch_depth + 1) * layer_padded + small_padded) * p
    grad_buffers = 0
    if not (direct and dtype == "fp32"):  # else gradients land straight in the fp32 shard
        staging = not direct and dtype != reduce_dtype  # fp32 copy of a bf16 gradient
        grad_buffers += edge_padded * p + edge_shard * r + (edge_padded * r if staging else 0)
        grad_buffers += 2 * (layer_padded * p + layer_shard * r)
        grad_buffers += layer_padded * r if staging else 0  # one staging for both slots
        grad_buffers += small_padded * p + (0 if direct else _shard(u.small, world) * r)
    return {
        "master_weights": 4 * shards,
        "gradients": 4 * shards,
        "optimizer_state": 8 * shards,
        "gather_input_copy": 0 if dtype == "fp32" else p * shards,
        "gather_buffers": gather,
        "gradient_buffers": grad_buffers,
    }


# ----------------------------------------------------------------------------- activations


@dataclass(frozen=True)
class ActivationSizes:
    """Bytes of one micro-batch's activations (see module docstring for what is counted)."""

    full_layer: int  # saved by a decoder layer that is not checkpointed
    checkpointed_layer: int  # its input only
    backward_workspace: int  # gradients in flight inside one layer's backward
    final_norm: int
    logits: int  # the loop holds the logits until the next micro-batch
    loss: int  # fp32 log-softmax output and two fp32 gradients of it, at once
    batch: int  # input and target token ids (int64) and the rotary tables

    @classmethod
    def of(cls, m: ModelConfig, seq_len: int, micro_batch: int, dtype: str) -> ActivationSizes:
        p, n, d = dtype_bytes(dtype), seq_len * micro_batch, m.dim
        kv = m.n_kv_heads * m.head_dim
        norm = n * (4 * d + 2 * p * d)  # fp32 input (pow), normalised (mul), output (linear)
        attention = n * p * (2 * d + 2 * kv)  # rotated q, k; v; attention output
        lse = 4 * micro_batch * m.n_heads * seq_len  # fp32 log-sum-exp per query and head
        ffn = 4 * n * p * m.ffn_dim  # w1 x (silu input), silu, w3 x, their product
        return cls(
            full_layer=2 * norm + attention + lse + ffn,
            checkpointed_layer=n * p * d,
            backward_workspace=2 * n * p * m.ffn_dim + n * p * d,
            final_norm=norm,
            logits=n * p * m.vocab_size,
            loss=12 * n * m.vocab_size,
            batch=16 * n + 4 * seq_len * m.head_dim,
        )


def activation_peak(
    a: ActivationSizes, n_layers: int, checkpointed: int, grad_norm_scratch: int
) -> tuple[str, dict[str, int]]:
    """The largest moment of a step above the resident state: (moment, its parts in bytes)."""
    saved = checkpointed * a.checkpointed_layer + (n_layers - checkpointed) * a.full_layer
    moments = {
        "loss": {
            "activations": saved + a.final_norm,
            "logits_and_loss": a.logits + a.loss,
            "backward_workspace": 0,
        },
        "backward of the last layer": {
            "activations": saved,
            "logits_and_loss": a.logits,
            "backward_workspace": a.backward_workspace,
        },
        "gradient norm": {
            "activations": 0,
            "logits_and_loss": a.logits,
            "backward_workspace": grad_norm_scratch,
        },
    }
    if checkpointed == n_layers:  # no layer keeps its activations: only the recompute does
        del moments["backward of the last layer"]
    if checkpointed:
        moments["recompute of the last checkpointed layer"] = {
            "activations": checkpointed * a.checkpointed_layer + a.full_layer,
            "logits_and_loss": a.logits,
            "backward_workspace": a.backward_workspace,
        }
    return max(moments.items(), key=lambda kv: sum(kv[1].values()))


def recompute_fraction(m: ModelConfig, seq_len: int, checkpointed: int) -> float:
    """Extra FLOPs of recomputing the checkpointed layers' forward, as a share of the step's
    useful FLOPs (``flops_per_token``): each layer forward is 2 x weights + 4 x seq x dim."""
    layer_forward = 2 * UnitSizes.of(m).layer + 4 * seq_len * m.n_heads * m.head_dim
    return checkpointed * layer_forward / flops_per_token(m, seq_len)


# ----------------------------------------------------------------------------- the plan


@dataclass
class MemoryPlan:
    """The planner's answer for one recipe on ``world_size`` GPUs (all sizes in bytes)."""

    world_size: int
    n_layers: int
    seq_len: int
    micro_batch_size: int
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
    min_gpus: int | None = None  # when nothing fits: the smallest GPU count that does
    recipe_setting: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def _recipe_shape(recipe: Recipe) -> tuple:
    s = recipe.sharding
    return recipe.model, s.reduce_dtype, s.prefetch_depth, recipe.train.dtype


def plan_for_layers(
    recipe: Recipe, world_size: int, checkpointed: int, gpu_memory_bytes: int | None = None,
    runtime_allowance_bytes: int | None = None,
) -> MemoryPlan:  # fmt: skip
    """Peak memory per GPU with the first ``checkpointed`` decoder layers checkpointed."""
    m, reduce_dtype, depth, dtype = _recipe_shape(recipe)
    if runtime_allowance_bytes is None:
        runtime_allowance_bytes = default_runtime_allowance(gpu_memory_bytes or 0)
    state = engine_state_bytes(m, world_size, dtype, reduce_dtype, depth)
    acts = ActivationSizes.of(m, recipe.data.seq_len, recipe.data.micro_batch_size, dtype)
    # clip_grad_norm_ reduces with vector_norm: no scratch the size of the gradient shard.
    moment, parts = activation_peak(acts, m.n_layers, checkpointed, 0)
    breakdown = {**state, "batch_and_rope": acts.batch, **parts}
    tensor_peak = sum(breakdown.values())
    breakdown["runtime_allowance"] = runtime_allowance_bytes
    peak = tensor_peak + runtime_allowance_bytes
    return MemoryPlan(
        world_size=world_size,
        n_layers=m.n_layers,
        seq_len=recipe.data.seq_len,
        micro_batch_size=recipe.data.micro_batch_size,
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
    )


def min_gpus_to_fit(
    recipe: Recipe, world_size: int, gpu_memory_bytes: int, runtime_allowance_bytes: int | None
) -> int | None:
    """Smallest GPU count >= world_size at which all layers checkpointed fit; None if the
    unsharded part (buffers, activations, allowance) alone is too big for any count."""
    n = recipe.model.n_layers

    def fits(world: int) -> bool:
        plan = plan_for_layers(recipe, world, n, gpu_memory_bytes, runtime_allowance_bytes)
        return bool(plan.fits)

    high = world_size
    while not fits(high):
        if high >= 2**24:
            return None
        high *= 2
    low = max(world_size, high // 2)
    while low < high:  # sharded bytes only shrink as the count grows
        mid = (low + high) // 2
        low, high = (low, mid) if fits(mid) else (mid + 1, high)
    return high


def plan_memory(
    recipe: Recipe,
    world_size: int,
    gpu_memory_bytes: int | None,
    runtime_allowance_bytes: int | None = None,
) -> MemoryPlan:
    """The smallest number of checkpointed first layers that fits ``gpu_memory_bytes``.

    Without a memory limit the recipe's own setting is reported (0 for ``auto``). When even
    all layers checkpointed do not fit, the plan has ``fits=False``, all layers, and
    ``min_gpus``. ``recipe_setting`` holds the plan for the recipe's own number.
    """
    n = recipe.model.n_layers
    setting = recipe.sharding.activation_checkpoint_layers
    own = 0 if setting == "auto" else int(setting)
    args = (gpu_memory_bytes, runtime_allowance_bytes)
    recipe_plan = plan_for_layers(recipe, world_size, own, *args)
    if gpu_memory_bytes is None:
        plan = recipe_plan
    else:
        plan = next(
            (p for k in range(n + 1) if (p := plan_for_layers(recipe, world_size, k, *args)).fits),
            None,
        )
        if plan is None:
            plan = plan_for_layers(recipe, world_size, n, *args)
            plan.min_gpus = min_gpus_to_fit(recipe, world_size, *args)
    plan.recipe_setting = {
        "activation_checkpoint_layers": setting,
        "peak_bytes_per_gpu": recipe_plan.peak_bytes_per_gpu,
        "fits": recipe_plan.fits,
    }
    return plan
