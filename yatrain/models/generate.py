"""Sampling from a Llama in plain PyTorch (one process, no engine), with a key/value cache.

The prompt runs through the model once (prefill), filling every layer's cache with its keys
and values; each new token then runs alone, attending over the cache. The cached path uses
the model's own modules (``DecoderLayer`` attending through a cache), so it computes what a full
forward over the whole sequence computes; ``use_cache=False`` runs exactly that full forward
at every step (the reference the tests compare with). Temperature 0 is greedy decoding (the
argmax at every step); otherwise the logits are divided by the temperature, cut to the
``top_k`` most likely tokens and to the smallest set whose probability reaches ``top_p``,
and sampled with a seeded generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from yatrain.models.llama import Llama


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen from the logits."""

    temperature: float = 0.8  # 0 = greedy
    top_k: int | None = None  # keep the k most likely tokens; None = all
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches p


class LayerKV:
    """One layer's keys and values, preallocated for the whole generation."""

    def __init__(self, shape: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> None:
        self.k = torch.empty(shape, device=device, dtype=dtype)
        self.v = torch.empty(shape, device=device, dtype=dtype)
        self.length = 0

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store k, v at the next positions; causal attention of q over all positions."""
        start, new = self.length, k.shape[2]
        end = start + new
        self.k[:, :, start:end], self.v[:, :, start:end] = k, v
        self.length = end
        keys, values = self.k[:, :, :end], self.v[:, :, :end]
        if new == 1:  # one new token sees every position: no mask
            return F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)
        if start == 0:
            return F.scaled_dot_product_attention(q, keys, values, is_causal=True, enable_gqa=True)
        rows = torch.arange(start, end, device=q.device)[:, None]
        mask = rows >= torch.arange(end, device=q.device)[None, :]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)


class KVCache:
    """Every layer's keys and values for ``length`` positions of ``batch`` sequences."""

    def __init__(self, model: Llama, batch: int, length: int) -> None:
        cfg, weight = model.cfg, model.tok_embeddings.weight
        shape = (batch, cfg.n_kv_heads, length, cfg.head_dim)
        self.layers = [LayerKV(shape, weight.device, weight.dtype) for _ in model.layers]

    @property
    def length(self) -> int:
        return self.layers[0].length


def next_logits(model: Llama, tokens: torch.Tensor, cache: KVCache | None) -> torch.Tensor:
    """Logits [B, vocab] of the position after ``tokens`` [B, T]: with a cache, ``tokens``
    are the positions not yet in it; without, the whole sequence (a full forward)."""
    if cache is None:
        return model(tokens)[:, -1]
    start, length = cache.length, tokens.shape[1]
    cos, sin = model.rope(model.cfg.max_seq_len, tokens.device)
    cos, sin = cos[start : start + length], sin[start : start + length]
    x = model.tok_embeddings(tokens)
    for layer, kv in zip(model.layers, cache.layers, strict=True):
        x = layer(x, cos, sin, None, kv)
    return model.output(model.norm(x[:, -1:]))[:, -1]


def choose(
    logits: torch.Tensor,
    sampling: Sampling,
    generator: torch.Generator | None,
    vocab_limit: int | None = None,
) -> int:
    """The next token id from one position's logits [vocab] (see the module docstring);
    ids at or above ``vocab_limit`` (rows the tokenizer has no token for) are never chosen."""
    logits = logits.float().clone()
    if vocab_limit is not None and vocab_limit < logits.shape[0]:
        logits[vocab_limit:] = -float("inf")
    if sampling.temperature == 0:
        return int(logits.argmax())
    # From the largest logit down, in float64: a tiny temperature then sends the others to
    # -inf (greedy in the limit), never the largest to inf (which softmax turns into NaN).
    logits = (logits.double() - logits.max()) / sampling.temperature
    if sampling.top_k is not None and sampling.top_k < logits.shape[0]:
        kth = torch.topk(logits, sampling.top_k).values[-1]
        logits[logits < kth] = -float("inf")
    probs = torch.softmax(logits, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=0) - sorted_probs  # mass of the likelier ones
        probs[order[before >= sampling.top_p]] = 0.0  # the first token always stays
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def generate(
    model: Llama,
    prompt: list[int],
    *,
    max_new_tokens: int,
    sampling: Sampling,
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
    vocab_limit: int | None = None,
    use_cache: bool = True,
) -> tuple[list[int], str]:
    """New token ids after ``prompt`` and why generation stopped: ``"eos"`` (the EOS id,
    included, was generated), ``"max_new_tokens"``, or ``"context"`` (the model's
    ``max_seq_len`` is full)."""
    limit = model.cfg.max_seq_len
    if not prompt or len(prompt) > limit:
        raise ValueError(f"the prompt must have 1 to {limit} tokens, got {len(prompt)}")
    budget = min(max_new_tokens, limit - len(prompt))
    device = model.tok_embeddings.weight.device
    tokens = torch.tensor([prompt], dtype=torch.long, device=device)
    cache = KVCache(model, 1, len(prompt) + budget) if use_cache else None
    pending, new = tokens, []
    for _ in range(budget):
        token = choose(next_logits(model, pending, cache)[0], sampling, generator, vocab_limit)
        new.append(token)
        if token == eos_id:
            return new, "eos"
        step = torch.tensor([[token]], dtype=torch.long, device=device)
        tokens = torch.cat([tokens, step], dim=1)
        pending = step if use_cache else tokens
    return new, "max_new_tokens" if budget == max_new_tokens else "context"
