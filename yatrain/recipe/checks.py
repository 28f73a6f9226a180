"""Cross-field recipe checks: shapes the model or the batching cannot satisfy.

Field types and ranges are checked while the recipe is built (``schema.build_dataclass``);
what only a combination of keys can break is checked here, first failure wins, one line
naming the keys and the fix.
"""

from __future__ import annotations

import math
from pathlib import Path

from yatrain.errors import ConfigError
from yatrain.recipe.config import (
    GPU_GIB_MAX,
    GPU_GIB_MIN,
    MUON_KEYS,
    STAGING_MIN_MIB,
    DataConfig,
    OptimConfig,
    Recipe,
)


def check_shapes(r: Recipe) -> None:
    """Cross-field checks: shapes the model or the batching cannot satisfy (first one wins)."""
    m, data, optim = r.model, r.data, r.optim
    divisors = ", ".join(str(k) for k in range(1, m.n_heads + 1) if m.n_heads % k == 0)
    micro, gbs = data.micro_batch_size, data.global_batch_size
    n_ckpt = r.sharding.activation_checkpoint_layers
    too_deep = n_ckpt != "auto" and n_ckpt > m.n_layers  # "auto" never exceeds the depth
    rs = m.rope_scaling
    band = rs is not None and rs.high_freq_factor <= rs.low_freq_factor
    checks = [
        (
            m.dim % m.n_heads,
            f"'model.dim' ({m.dim}) is not divisible by 'model.n_heads' "
            f"({m.n_heads}); choose n_heads that divides dim",
        ),
        (
            m.n_heads % m.n_kv_heads,
            f"'model.n_heads' ({m.n_heads}) is not divisible by "
            f"'model.n_kv_heads' ({m.n_kv_heads}); set n_kv_heads to one of {divisors}",
        ),
        (
            m.head_dim % 2,
            f"head dim 'model.dim'/'model.n_heads' = {m.head_dim} is odd; "
            "rotary embeddings need an even head dim, change dim or n_heads",
        ),
        (
            data.seq_len > m.max_seq_len,
            f"'data.seq_len' ({data.seq_len}) exceeds "
            f"'model.max_seq_len' ({m.max_seq_len}); lower one or raise the other",
        ),
        (
            gbs % micro,
            f"'data.global_batch_size' ({gbs}) is not a multiple of "
            f"'data.micro_batch_size' ({micro}); use e.g. {-(-gbs // micro) * micro}",
        ),
        (
            too_deep,
            f"'sharding.activation_checkpoint_layers' ({n_ckpt}) exceeds "
            f"'model.n_layers' ({m.n_layers}); use 0..{m.n_layers}",
        ),
        (
            band,
            "'model.rope_scaling.high_freq_factor' must exceed low_freq_factor (Llama 3.1: "
            "4 and 1)",
        ),
        (
            optim.min_lr > optim.lr,
            f"'optim.min_lr' ({optim.min_lr}) is greater than "
            f"'optim.lr' ({optim.lr}); the schedule decays from lr down to min_lr, lower it",
        ),
    ]
    for failed, message in checks:
        if failed:
            raise ConfigError(message)
    _check_sources(data)
    _check_optimizer(optim)
    _check_context_parallel(r)
    _check_staging(r)
    _check_gpu_memory(r)


def _check_optimizer(optim: OptimConfig) -> None:
    """Muon's keys only with Muon (else a key the run would silently ignore)."""
    stray = [key for key in MUON_KEYS if getattr(optim, key) is not None]
    if optim.name != "muon" and stray:
        raise ConfigError(
            f"'optim.{stray[0]}' is a Muon key but 'optim.name' is {optim.name}; set "
            "optim.name: muon, or remove the key"
        )


def _check_gpu_memory(r: Recipe) -> None:
    """``sharding.gpu_memory_gib`` within ``--gpu-memory``'s bounds."""
    gib = r.sharding.gpu_memory_gib
    if gib is not None and not GPU_GIB_MIN <= gib <= GPU_GIB_MAX:
        raise ConfigError(
            f"'sharding.gpu_memory_gib' ({gib:g}) must be from {GPU_GIB_MIN} to {GPU_GIB_MAX} "
            "GiB per device (as yatrain plan --gpu-memory); set the GPU's memory, e.g. 80, or "
            "null to plan against the device's own"
        )


def cuts_window(seq_len: int, cp: int) -> bool:
    """Whether ``cp`` ranks can share a window of ``seq_len`` tokens: each holds 2 of 2 x CP
    equal chunks (the zigzag that balances causal attention); one rank holds it whole."""
    return cp == 1 or seq_len % (2 * cp) == 0


def _check_context_parallel(r: Recipe) -> None:
    """A window is cut into 2 x CP equal chunks. The fix named is one the recipe can take: a
    length within model.max_seq_len, else a CP size that cuts this length."""
    cp, seq_len = r.sharding.context_parallel, r.data.seq_len
    chunks = 2 * cp
    if cuts_window(seq_len, cp):
        return
    lengths = (-(-seq_len // chunks) * chunks, seq_len // chunks * chunks)
    fixes = [str(n) for n in lengths if 0 < n <= r.model.max_seq_len][:1]
    smaller = math.gcd(cp, seq_len // 2) if seq_len % 2 == 0 else 1  # divides cp and seq / 2
    if smaller > 1 or not fixes:
        fixes.append(f"sharding.context_parallel {smaller}")
    raise ConfigError(
        f"'data.seq_len' ({seq_len}) is not a multiple of 2 x 'sharding.context_parallel' "
        f"= {chunks} (each rank holds 2 of {chunks} equal chunks of a window); use e.g. "
        f"{' or '.join(fixes)}"
    )


def _check_staging(r: Recipe) -> None:
    """A staging budget of bytes would reduce each gradient a column at a time."""
    mib = r.sharding.reduce_staging_mib
    if mib != "auto" and mib < STAGING_MIN_MIB:
        raise ConfigError(
            f"'sharding.reduce_staging_mib' ({mib}) is below {STAGING_MIN_MIB} MiB: every "
            f"layer's gradients would go in up to millions of reduce-scatters; set it to "
            f"{STAGING_MIN_MIB} or more, or auto"
        )


def _check_sources(data: DataConfig) -> None:
    """data.path or data.sources, not both; a mixture names each directory once."""
    if data.path is None and data.sources is None:
        raise ConfigError(
            "missing required key 'data.path' (or 'data.sources' for a weighted mixture); add "
            "it to the recipe (see recipes/llama3_8b.yaml for a complete example)"
        )
    if data.path is not None and data.sources is not None:
        raise ConfigError(
            "'data.path' and 'data.sources' are both set: train on one directory (data.path) "
            "or a mixture (data.sources), e.g. --set data.path=null"
        )
    if data.sources is not None:
        if not data.sources:
            raise ConfigError("'data.sources' is empty: list at least one {path, weight}")
        seen: dict[str, int] = {}
        names: dict[str, int] = {}
        for i, source in enumerate(data.sources):
            key = str(Path(source.path))
            if key in seen:
                raise ConfigError(
                    f"'data.sources[{i}].path' repeats data.sources[{seen[key]}] ({source.path}): "
                    "list each directory once and give it the combined weight"
                )
            if source.label in names:
                raise ConfigError(
                    f"'data.sources[{i}]' and data.sources[{names[source.label]}] are both "
                    f"named {source.label!r} in logs: give one a 'name'"
                )
            seen[key], names[source.label] = i, i
    if data.restart_positions and not data.document_mask:
        raise ConfigError(
            "'data.restart_positions' needs 'data.document_mask: true' (positions restart "
            "where attention stops at a document boundary)"
        )


def check_vocab(recipe: Recipe, tokenizer_vocab_size: int) -> None:
    """The embedding table must have a row for every token id the tokenizer can produce."""
    if recipe.model.vocab_size < tokenizer_vocab_size:
        raise ConfigError(
            f"'model.vocab_size' ({recipe.model.vocab_size}) is smaller than the tokenizer's "
            f"vocabulary ({tokenizer_vocab_size}); set model.vocab_size to at least "
            f"{tokenizer_vocab_size}"
        )
