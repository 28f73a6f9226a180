"""What a step's activations cost: the bytes a decoder layer saves for backward (eager or
compiled), a checkpointed layer, the fused loss, and the largest moment of a step.

See ``memory.py``'s docstring for what is counted; tests compare these with live-tensor
counts of real engine steps and with what compiled layers save (``saved_tensors_hooks``).
"""

from __future__ import annotations

from dataclasses import dataclass

from yatrain.common import dtype_bytes
from yatrain.context_parallel.group import MASK_ELEMENTS
from yatrain.plan.layout import unit_layouts
from yatrain.recipe.config import ModelConfig


@dataclass(frozen=True)
class GradientShards:
    """Bytes of the fp32 gradient shards: each unit's is allocated at its first reduction
    in a step and freed after the optimizer step."""

    all_units: int
    head: int  # the last unit (reduced first in the backward)
    layer: int  # one inner unit

    @classmethod
    def of(cls, m: ModelConfig, world: int) -> GradientShards:
        layouts, _ = unit_layouts(m, world)
        shards = [4 * layout.shard_numel for layout in layouts]
        owned = sum(size for size, layout in zip(shards, layouts, strict=True) if layout.owns)
        # a tied head's shard is its embedding's, allocated at the head's reduction
        return cls(owned, shards[-1], max(shards[1:-1], default=0))


@dataclass(frozen=True)
class ActivationSizes:
    """Bytes of one micro-batch's activations (see module docstring for what is counted)."""

    full_layer: int  # saved by a decoder layer that is not checkpointed
    checkpointed_layer: int  # its input only
    backward_workspace: int  # gradients in flight inside one layer's backward
    final_norm: int
    loss: int  # one chunk's logits, fp32 and cast, and the hidden states' gradient
    head_gradient: int  # the output head's weight gradient (parameter dtype)
    batch: int  # input and target token ids (int64) and the rotary tables
    mask: int = 0  # attention masks alive through the micro-batch (``attention_masks``)

    @classmethod
    def of(
        cls,
        m: ModelConfig,
        seq_len: int,
        micro_batch: int,
        dtype: str,
        chunk_tokens: int,
        compiled: bool = False,
        context_parallel: int = 1,
        document_mask: bool = False,
    ) -> ActivationSizes:
        """Under context parallelism (``context_parallel`` = CP > 1) a rank holds
        ``seq_len / CP`` tokens of each window and every layer saves the window's gathered
        keys and values for its backward (``gathered_kv``)."""
        p, d, cp = dtype_bytes(dtype), m.dim, context_parallel
        local = seq_len // cp  # this rank's tokens of each window
        n = local * micro_batch
        lse = 4 * micro_batch * m.n_heads * local  # fp32 log-sum-exp per query and head
        chunk = min(chunk_tokens, n)
        logits = chunk * m.vocab_size * (4 + (p if p != 4 else 0))  # fp32 (+ cast) logits
        gathered = gathered_kv(m, seq_len, micro_batch, p) if cp > 1 else 0
        kv_local = 2 * n * p * m.n_kv_heads * m.head_dim if cp > 1 else 0  # not kept under CP
        # under CP attention runs in pieces (``context_parallel.attention``): SDPA keeps each
        # piece's output and ``wo`` their concatenation, a second copy of the output
        pieces = n * p * d if cp > 1 else 0
        ffn_saved = (3 if compiled else 4) * n * p * m.ffn_dim  # ffn-sized saved tensors
        # without CP, SDPA makes the boolean document mask additive in each layer and keeps
        # that copy for the backward (measured: tests/integration/test_plan_context.py)
        converted = micro_batch * seq_len * seq_len * p if document_mask and cp == 1 else 0
        return cls(
            full_layer=(compiled_layer if compiled else eager_layer)(m, n, p)
            + lse
            + gathered
            - kv_local
            + pieces
            + converted,
            checkpointed_layer=n * p * d,
            # two ffn-sized gradients inside a layer's backward and its input's gradient (a
            # weight's gradient on its way into the gradient buffer overlaps with freed
            # activations: counting it overestimates every measured case); under CP the
            # gathered keys' and values' gradient and its copy for the reduce-scatter, in
            # the attention's backward: after the feed-forward's has freed what it saved
            backward_workspace=n * p * d + max(2 * n * p * m.ffn_dim, 2 * gathered - ffn_saved),
            final_norm=norm_saved(n, d, p),
            loss=logits + n * p * d,
            head_gradient=p * m.vocab_size * d,
            batch=16 * n + 4 * local * m.head_dim,
            mask=attention_masks(seq_len, micro_batch, p, cp, document_mask),
        )


def gathered_kv(m: ModelConfig, seq_len: int, micro_batch: int, p: int) -> int:
    """Bytes of one layer's keys and values over a whole window, as context parallelism
    all-gathers them (``context_parallel.group``) and attention saves them for its backward."""
    return 2 * micro_batch * seq_len * m.n_kv_heads * m.head_dim * p


def attention_masks(seq_len: int, micro_batch: int, p: int, cp: int, documents: bool) -> int:
    """Bytes of the masks one micro-batch keeps through its forward and backward.

    Documents masked (``data.document_mask``): dense. Without CP the model's boolean
    [B, 1, T, T] (``models.llama.document_causal_mask``; each layer that keeps its
    activations also keeps an additive copy, counted in its bytes); under CP
    (``context_parallel.attention``) each local chunk's additive [B, 1, w, end] mask in the
    compute dtype, w = T / (2 CP): B w^2 (2 CP + 1) elements a rank, T^2 / CP^2 shrinking.
    Plain causal under CP: one shared additive mask of at most ``MASK_ELEMENTS`` (CPU)."""
    if documents and cp == 1:
        return micro_batch * seq_len * seq_len
    width = seq_len // (2 * cp)
    if documents:
        return micro_batch * width * width * (2 * cp + 1) * p
    if cp > 1:
        return min(width, max(1, MASK_ELEMENTS // seq_len)) * seq_len * p
    return 0


def norm_saved(n: int, d: int, p: int) -> int:
    """An eager RMSNorm's saved tensors: fp32 input (pow), normalised (mul), output (linear)."""
    return n * (4 * d + 2 * p * d)


def eager_layer(m: ModelConfig, n: int, p: int) -> int:
    """Bytes an eager decoder layer saves for backward over ``n`` tokens (no log-sum-exp)."""
    d, kv = m.dim, m.n_kv_heads * m.head_dim
    norm = norm_saved(n, d, p)
    attention = n * p * (2 * d + 2 * kv)  # rotated q, k; v; attention output
    ffn = 4 * n * p * m.ffn_dim  # w1 x (silu input), silu, w3 x, their product
    return 2 * norm + attention + ffn


def compiled_layer(m: ModelConfig, n: int, p: int) -> int:
    """The same for a compiled layer (train.compile). Measured (tests/unit/test_plan_compile.py):
    the partitioner keeps each norm's fp32 reciprocal RMS and recomputes the normalised and
    SiLU tensors in backward, so six dim-sized tensors (the layer input, the residual after
    attention, q and the attention output, the inputs of wo and of the SwiGLU), k, v and
    three ffn-sized tensors remain: 0.76x an eager layer's bytes in fp32, 0.69x in bf16."""
    kv = m.n_kv_heads * m.head_dim
    return n * p * (6 * m.dim + 2 * kv + 3 * m.ffn_dim) + 2 * 4 * n


def activation_peak(
    a: ActivationSizes,
    n_layers: int,
    checkpointed: int,
    g: GradientShards,
    accumulating: bool,
    direct: bool = False,
    optimizer: int = 0,
) -> tuple[str, dict[str, int]]:
    """The largest moment of a step above the resident state: (moment, its parts in bytes).

    Moments: the loss; the backward of each layer that kept its activations and the
    recompute of each checkpointed one (the layers above it have freed theirs, and their
    gradient shards exist: a unit's from its first reduction on, every unit's through a
    later micro-batch of several, ``accumulating``; on the ``direct`` path of one process
    also the running layer's, which its first weight gradient fills); the gradient norm;
    with ``optimizer`` bytes (a Muon step's updates and exchange, ``plan/muon.py``) the
    optimizer step, every gradient shard still held."""
    k, n = checkpointed, n_layers

    def moment(
        acts: int, loss: int, head: int, workspace: int, grads: int, step: int = 0
    ) -> dict[str, int]:
        parts = {
            "activations": acts,
            "logits_and_loss": loss,
            "head_gradient": head,
            "backward_workspace": workspace,
            "gradients": grads,
        }
        return {**parts, "optimizer_workspace": step} if optimizer else parts

    def reduced(layers_above: int) -> int:  # the head and the layers above this one
        return g.all_units if accumulating else g.head + (layers_above + direct) * g.layer

    saved = k * a.checkpointed_layer + (n - k) * a.full_layer
    moments = {
        "loss": moment(
            saved + a.final_norm, a.loss, a.head_gradient, 0, g.all_units if accumulating else 0
        ),
        "gradient norm": moment(0, 0, 0, 0, g.all_units),
    }
    if optimizer:
        moments["optimizer step"] = moment(0, 0, 0, 0, g.all_units, optimizer)
    for i in range(n - 1, k - 1, -1):  # layers that kept their activations
        acts = k * a.checkpointed_layer + (i - k + 1) * a.full_layer
        head = a.head_gradient if i == n - 1 else 0  # reduced while the last layer runs
        moments[f"backward of layer {i}"] = moment(
            acts, 0, head, a.backward_workspace, reduced(n - 1 - i)
        )
    for j in range(k - 1, -1, -1):  # checkpointed layers: their inputs, one recomputed
        acts = (j + 1) * a.checkpointed_layer + a.full_layer
        moments[f"recompute of layer {j}"] = moment(
            acts, 0, 0, a.backward_workspace, reduced(n - 1 - j)
        )
    return max(moments.items(), key=lambda kv: sum(kv[1].values()))
