"""Llama 2/3 decoder in plain PyTorch (Meta's reference layout and parameter names).

The model holds parameters only, no buffers: it is built on the meta device, materialised unit
by unit, and its parameters are then owned by a sharding engine. That engine knows nothing about
Llama; it sees ``units()`` (embedding, each decoder layer, output head) and ``norm_modules()``.
Parameter names match Meta's checkpoints (tok_embeddings, layers.N.attention.wq, ...) so export
is a rename-free state_dict.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from yatrain.models.loss import linear_cross_entropy
from yatrain.models.rope import apply_rope, rope_cos_sin
from yatrain.recipe.config import LOSS_CHUNK_TOKENS, ModelConfig

INIT_STD = 0.02
SEED_STRIDE = 1_000_003  # unit i of a run with seed s draws from generator seed s*STRIDE + i


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 so bf16 activations don't lose precision."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def document_causal_mask(document_ids: torch.Tensor, start: int = 0, stop: int = 0) -> torch.Tensor:
    """[B, 1, T, T] boolean: query t may attend key s iff s <= t and both are in one document
    (block-diagonal causal; every query keeps at least itself). With ``stop``: the queries
    ``start..stop-1`` of the window against keys ``0..stop-1`` only (a chunk of it)."""
    stop = stop or document_ids.shape[1]
    queries, keys = document_ids[:, None, start:stop, None], document_ids[:, None, None, :stop]
    causal = torch.ones(stop - start, stop, dtype=torch.bool, device=document_ids.device)
    return (queries == keys) & causal.tril(start)


class Attend(Protocol):
    """Attention over more keys and values than this call's own, mask included: a cache of
    earlier positions (``models.generate.LayerKV``) or a window's gathered from the ranks that
    share it (``context_parallel``); the model itself stays one device's."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [B, heads, T, D] over k, v [B, kv heads, T, D] and what else it holds."""
        ...


class Attention(nn.Module):
    """Causal multi-head attention with grouped-query K/V heads and rotary positions; with an
    ``attend`` (a KV cache, a gathered window) the queries attend through it (``Attend``)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None = None,
        attend: Attend | None = None,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, T, D]
        if attend is not None:
            y = attend.attend(q, k, v)
        elif mask is None:  # the plain causal path: lets SDPA pick its fastest kernel
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x), with w1 the gate and w3 the up projection."""

    def __init__(self, dim: int, ffn_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, ffn_dim, bias=False)
        self.w2 = nn.Linear(ffn_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class DecoderLayer(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then h + ffn(norm(h))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_dim)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None = None,
        attend: Attend | None = None,
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, mask, attend)
        return h + self.feed_forward(self.ffn_norm(h))


class OutputHead(nn.Module):
    """The vocabulary projection. Given targets it returns the mean cross-entropy instead of
    logits, fused with the projection and computed chunk by chunk of tokens inside this one
    call (see models/loss.py), so a sharding engine gathers its weights and reduces their
    gradient once per micro-batch however many chunks there are."""

    def __init__(self, dim: int, vocab_size: int, chunk_tokens: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, dim))
        self.chunk_tokens = chunk_tokens

    def forward(self, h: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if targets is None:  # evaluation and generation: plain logits
            return F.linear(h, self.weight)
        return linear_cross_entropy(h, self.weight, targets, self.chunk_tokens)


class Llama(nn.Module):
    """Token embedding, n_layers decoder layers, final RMSNorm, output head.

    With ``tie_embeddings`` the head's weight *is* the embedding's Parameter (Llama 3.2
    1B/3B): one tensor, listed by both units. The engine sees the shared Parameter and
    gives the head no shard of its own (``sharding.layout``: a borrowed unit)."""

    def __init__(
        self,
        cfg: ModelConfig,
        activation_checkpoint_layers: int = 0,
        loss_chunk_tokens: int = LOSS_CHUNK_TOKENS,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.activation_checkpoint_layers = activation_checkpoint_layers  # first N layers
        table = torch.empty(cfg.vocab_size, cfg.dim)  # init_weights_ draws it: no dynamo import
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim, _weight=table)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = OutputHead(cfg.dim, cfg.vocab_size, loss_chunk_tokens)
        # (seq_len, device) -> (cos, sin): a dict, not buffers (never moved, sharded or saved)
        self.rope_cache: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self.tie_weights_()
        self._register_load_state_dict_pre_hook(self._tied_state)

    def tie_weights_(self) -> None:
        """Make the head's weight the embedding's Parameter (a no-op when untied)."""
        if self.cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def to_empty(self, *, device: torch.device | str | None, recurse: bool = True) -> Llama:
        """As ``nn.Module.to_empty``, which gives each module new Parameters: re-tie."""
        super().to_empty(device=device, recurse=recurse)
        self.tie_weights_()
        return self

    def _tied_state(self, state: dict, prefix: str, *args) -> None:
        """A tied model's saved weights hold the embedding once: it is the head's too."""
        embedding, head = f"{prefix}tok_embeddings.weight", f"{prefix}output.weight"
        if self.cfg.tie_embeddings and head not in state and embedding in state:
            state[head] = state[embedding]

    def rope(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (seq_len, str(device))
        if key not in self.rope_cache:
            cfg = self.cfg
            self.rope_cache[key] = rope_cos_sin(
                cfg.head_dim, seq_len, cfg.rope_theta, device, cfg.rope_scaling
            )
        return self.rope_cache[key]

    def forward(
        self,
        tokens: torch.Tensor,
        document_ids: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        attention: Attend | None = None,
    ) -> torch.Tensor:
        """tokens [B, T] (int64) -> logits [B, T, vocab_size] in the compute dtype; with
        ``targets`` [B, T], the mean cross-entropy loss (fp32 scalar) instead, computed by the
        output head chunk by chunk without full logits (models/loss.py).

        ``document_ids`` [B, T] keeps attention within each document of a packed sequence;
        ``positions`` [B, T] (each below max_seq_len) replaces 0..T-1 as rotary positions.
        ``attention`` replaces every layer's causal attention (``Attend``; under context
        parallelism ``tokens`` are this rank's part of a window, ``positions`` their places).
        """
        seq_len = tokens.shape[1]
        if seq_len > self.cfg.max_seq_len:
            raise ValueError(
                f"sequence length {seq_len} exceeds max_seq_len {self.cfg.max_seq_len}"
            )
        x = self.tok_embeddings(tokens)
        if positions is None:
            cos, sin = self.rope(seq_len, tokens.device)
        else:
            cos, sin = self.rope(self.cfg.max_seq_len, tokens.device)
            cos, sin = cos[positions], sin[positions]
        mask = None if document_ids is None else document_causal_mask(document_ids)
        for i, layer in enumerate(self.layers):
            if i < self.activation_checkpoint_layers and torch.is_grad_enabled():
                # Keep only the layer input; recompute its activations during backward.
                x = checkpoint(layer, x, cos, sin, mask, attention, use_reentrant=False)
            else:
                x = layer(x, cos, sin, mask, attention)
        h = self.norm(x)
        return self.output(h) if targets is None else self.output(h, targets)

    # ------------------------------------------------------------------ sharding interface

    def units(self) -> list[nn.Module]:
        """The modules a sharding engine gathers one at a time, in forward order."""
        return [self.tok_embeddings, *self.layers, self.output]

    def norm_modules(self) -> list[nn.Module]:
        """Every RMSNorm: per layer attention_norm then ffn_norm, then the final norm."""
        norms: list[nn.Module] = []
        for layer in self.layers:
            norms += [layer.attention_norm, layer.ffn_norm]
        return [*norms, self.norm]

    # ------------------------------------------------------------------ initialisation

    @torch.no_grad()
    def init_unit_(self, index: int, seed: int) -> None:
        """Initialise unit ``index`` (not its norm weights) in place, reproducibly.

        Each unit draws from its own generator seeded with ``seed * 1_000_003 + index`` on the
        device of its parameters, in named_parameters order, so the weights depend only on
        (seed, index, device) -- not on world size or on whether other units exist yet. Init in
        fp32: the same seed gives different values in another dtype. A tied head is the
        embedding (std 0.02, ``initializer_range`` of Llama 3.2's config.json): it draws
        nothing of its own.
        """
        unit = self.units()[index]
        if self.cfg.tie_embeddings and unit is self.output:
            return  # the embedding's weight, initialised with unit 0
        params = [(n, p) for n, p in unit.named_parameters() if not _is_norm(unit, n)]
        gen = torch.Generator(device=params[0][1].device)
        gen.manual_seed(seed * SEED_STRIDE + index)
        residual_std = INIT_STD / math.sqrt(2 * self.cfg.n_layers)
        for name, p in params:
            if unit is self.output:
                std = self.cfg.dim**-0.5
            elif name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
                std = residual_std  # scaled so the residual stream doesn't grow with depth
            else:
                std = INIT_STD
            p.normal_(mean=0.0, std=std, generator=gen)

    @torch.no_grad()
    def init_norms_(self) -> None:
        """Set every RMSNorm weight to 1."""
        for norm in self.norm_modules():
            norm.weight.fill_(1.0)

    def init_weights_(self, seed: int) -> None:
        """Initialise all units and norms; equal to doing each unit separately."""
        for i in range(len(self.units())):
            self.init_unit_(i, seed)
        self.init_norms_()


def _is_norm(unit: nn.Module, param_name: str) -> bool:
    owner = unit.get_submodule(param_name.rpartition(".")[0])
    return isinstance(owner, RMSNorm)


# ---------------------------------------------------------------------- helpers


def build_model(
    cfg: ModelConfig,
    activation_checkpoint_layers: int = 0,
    loss_chunk_tokens: int = LOSS_CHUNK_TOKENS,
) -> Llama:
    """The model on the meta device: shapes only, no memory, no init cost (even for 70B)."""
    with torch.device("meta"):
        return Llama(cfg, activation_checkpoint_layers, loss_chunk_tokens)


def materialize(model: Llama, device: torch.device | str, seed: int) -> Llama:
    """Allocate a meta model's parameters on device and initialise them from seed."""
    model.to_empty(device=device)
    model.init_weights_(seed)
    return model


def layer_matmul_weights(cfg: ModelConfig) -> int:
    """Elements of one decoder layer's matmul weights (attention and SwiGLU, no norms)."""
    d, hd = cfg.dim, cfg.head_dim
    attention = d * cfg.n_heads * hd * 2 + d * cfg.n_kv_heads * hd * 2  # wq, wo + wk, wv
    return attention + 3 * d * cfg.ffn_dim


def count_parameters(cfg: ModelConfig, include_embedding: bool = True) -> int:
    """Parameter count from the config alone (a tied embedding counted once);
    include_embedding=False counts the weights a token is multiplied by instead: without
    the input embedding table (a lookup, no FLOPs), with the output head (a real matmul,
    even when it is the embedding's weight)."""
    d = cfg.dim
    layer = layer_matmul_weights(cfg) + 2 * d  # + attention_norm, ffn_norm
    table = cfg.vocab_size * d
    matmul = cfg.n_layers * layer + d + table  # layers + final norm + output head
    if not include_embedding:
        return matmul
    return matmul if cfg.tie_embeddings else matmul + table


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward), the numerator of MFU.

    6 * N for the weight matmuls, N = all parameters except the input embedding table (the output
    head is counted; norm weights are too, a rounding error), plus 12 * n_layers * n_heads *
    head_dim * seq_len for the attention scores and weighted sum, WITHOUT halving for the causal
    mask (that is work the kernels skip, so MFU reads slightly high, as in PaLM/torchtitan).
    Recompute from activation checkpointing is not counted: MFU measures useful work only.
    """
    n = count_parameters(cfg, include_embedding=False)
    return 6.0 * n + 12.0 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len
