"""Hugging Face ``LlamaForCausalLM`` naming and layout, both ways.

Our attention uses Meta's rotary convention (rotate adjacent pairs); Hugging Face's rotates
the two halves of each head. The same model therefore stores ``wq``/``wk`` with each head's
rows permuted: ``to_hf`` applies that permutation, ``from_hf`` undoes it.

Reading a ``config.json`` we cannot honour is refused, never approximated: rotary scaling
other than Llama 3.1's ``llama3`` (yarn, linear, dynamic...) would change every attention
score, biases and other activations are not in our model. Llama 3.1's scaling is read
whether spelled ``rope_scaling`` (the published files) or ``rope_parameters``
(transformers 5.x), and written as both. Tied embeddings (``tie_word_embeddings``, Llama
3.2 1B/3B) map to ``model.tie_embeddings``: one tensor, ``model.embed_tokens.weight``.
"""

from __future__ import annotations

import torch

from yatrain.common import DTYPES
from yatrain.errors import ConfigError
from yatrain.recipe.config import ModelConfig, RopeScaling
from yatrain.recipe.schema import build_dataclass, to_dict

_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_name(name: str) -> str:
    if name in _TOP:
        return _TOP[name]
    _, index, rest = name.split(".", 2)  # layers.{i}.rest
    return f"model.layers.{index}.{_LAYER[rest]}"


def _heads_for(name: str, cfg: ModelConfig) -> int | None:
    if name.endswith("attention.wq.weight"):
        return cfg.n_heads
    if name.endswith("attention.wk.weight"):
        return cfg.n_kv_heads
    return None


def to_hf(name: str, tensor: torch.Tensor, cfg: ModelConfig) -> tuple[str, torch.Tensor]:
    heads = _heads_for(name, cfg)
    if heads is not None:
        rows, cols = tensor.shape
        tensor = tensor.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)
    return hf_name(name), tensor.contiguous()


def from_hf(name: str, tensor: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """``tensor`` stored under ``hf_name(name)``, in our layout."""
    heads = _heads_for(name, cfg)
    if heads is not None:
        rows, cols = tensor.shape
        tensor = tensor.view(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)
    return tensor


def rope_parameters(cfg: ModelConfig) -> dict:
    """``rope_parameters`` as transformers 5.x writes it (``rope_scaling`` for older)."""
    scaling = cfg.rope_scaling
    if scaling is None:
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    return {"rope_type": "llama3", "rope_theta": cfg.rope_theta, **to_dict(scaling)}


def source_rows(name: str, rows: range, total_rows: int, cfg: ModelConfig) -> list[int]:
    """The rows of the tensor stored under ``hf_name(name)`` that hold our rows ``rows``
    (``from_hf`` of a whole tensor, one row at a time): our row 2i + k of a head is
    Hugging Face's row k * head_dim / 2 + i of it."""
    heads = _heads_for(name, cfg)
    if heads is None:
        return list(rows)
    per_head = total_rows // heads
    half = per_head // 2
    found = []
    for row in rows:
        head, j = divmod(row, per_head)
        found.append(head * per_head + (j % 2) * half + j // 2)
    return found


def hf_config(cfg: ModelConfig, dtype: str, bos_id: int, eos_id: int) -> dict:
    scaling = rope_parameters(cfg) if cfg.rope_scaling is not None else None
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": rope_parameters(cfg),
        "rope_scaling": scaling,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": cfg.tie_embeddings,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": str(DTYPES[dtype]).removeprefix("torch."),
    }


def tied_embeddings(config: dict) -> bool:
    """Whether the model's output head is its embedding (``tie_word_embeddings``); a value
    other than true or false is refused (the string "true" once read as untied)."""
    tied = config.get("tie_word_embeddings", False)
    if not isinstance(tied, bool):
        raise ConfigError(
            f"config.json: 'tie_word_embeddings' is {tied!r:.60}, not true or false: fix it"
        )
    return tied


def hf_names(cfg: ModelConfig) -> set[str]:
    """The Hugging Face names of every tensor of a model of ``cfg``."""
    top = [name for name in _TOP if not (cfg.tie_embeddings and name == "output.weight")]
    layers = [f"layers.{i}.{rest}" for i in range(cfg.n_layers) for rest in _LAYER]
    return {hf_name(name) for name in [*top, *layers]}


def _rope(config: dict) -> tuple[str, dict]:
    """(rope type, its parameters) from ``rope_scaling`` or ``rope_parameters``; a file
    whose two spellings say different things is refused (which one would be meant?)."""
    spelled = [config.get(key) for key in ("rope_scaling", "rope_parameters")]
    described = [(_rope_kind(s), s) for s in spelled if s]
    if len(described) == 2 and _rope_differs(*described):
        (kind, first), (other, second) = described
        raise ConfigError(
            f"config.json: rope_scaling ({kind}) and rope_parameters ({other}) contradict each "
            "other: make them the same, or remove one"
        )
    return described[0] if described else ("default", {})


def _rope_kind(scaling: object) -> str:
    if not isinstance(scaling, dict):
        return repr(scaling)
    return str(scaling.get("rope_type") or scaling.get("type") or "default")


def _rope_differs(a: tuple[str, object], b: tuple[str, object]) -> bool:
    """Whether two descriptions of RoPE disagree on the type or a scaling value."""
    if a[0] != b[0]:
        return True
    first, second = (s if isinstance(s, dict) else {} for s in (a[1], b[1]))
    return any(first.get(k) != second.get(k) for k in _SCALING_KEYS if k in first and k in second)


_SCALING_KEYS = (
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
)


def rope_scaling_from_hf(config: dict) -> RopeScaling | None:
    """Llama 3.1's scaling from config.json, None for plain RoPE; ConfigError for a
    missing or mistyped key."""
    kind, scaling = _rope(config)
    if kind != "llama3":
        return None
    missing = [key for key in _SCALING_KEYS if scaling.get(key) is None]
    if missing:
        raise ConfigError(f"config.json: rope_type llama3 without {', '.join(missing)}")
    values = {key: scaling[key] for key in _SCALING_KEYS}
    return build_dataclass(RopeScaling, values, prefix="config.json: ")


def unsupported(config: dict) -> str | None:
    """What in a Llama ``config.json`` this model cannot reproduce, or None."""
    kind, _ = _rope(config)
    if kind not in ("default", "llama3"):
        return f"rotary scaling rope_type {kind!r} (yatrain reads only llama3, Llama 3.1's)"
    checks = [
        (
            config.get("model_type", "llama") != "llama",
            f"model_type {config.get('model_type')!r} (only llama is read)",
        ),
        (config.get("hidden_act", "silu") != "silu", f"hidden_act {config.get('hidden_act')!r}"),
        (config.get("attention_bias") or config.get("mlp_bias"), "bias terms"),
    ]
    return next((why for failed, why in checks if failed), None)


_REQUIRED_INTS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "vocab_size",
)


_CONFIG_KEYS = {  # model.KEY: the config.json key it is read from
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "ffn_dim": "intermediate_size",
    "vocab_size": "vocab_size",
    "rope_theta": "rope_theta",
    "norm_eps": "rms_norm_eps",
    "max_seq_len": "max_position_embeddings",
    "rope_scaling": "rope_scaling",
    "tie_embeddings": "tie_word_embeddings",
}


def model_config_from_hf(config: dict) -> ModelConfig:
    """The architecture a Hugging Face Llama ``config.json`` describes; ConfigError for a
    missing or mistyped field."""
    if not isinstance(config, dict):
        raise ConfigError("config.json is not a JSON object")
    for key in ("rope_scaling", "rope_parameters"):
        if config.get(key) is not None and not isinstance(config[key], dict):
            raise ConfigError(f"config.json: {key} is {config[key]!r:.60}, not an object")
    for key in _REQUIRED_INTS:
        value = config.get(key)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"config.json: {key} is {value!r}, not a whole number")
    theta = config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta")
    fields = {
        "dim": config.get("hidden_size"),
        "n_layers": config.get("num_hidden_layers"),
        "n_heads": config.get("num_attention_heads"),
        "n_kv_heads": config.get("num_key_value_heads", config.get("num_attention_heads")),
        "ffn_dim": config.get("intermediate_size"),
        "vocab_size": config.get("vocab_size"),
        "rope_theta": 1e4 if theta is None else theta,
        "norm_eps": config.get("rms_norm_eps", 1e-5),
        "max_seq_len": config.get("max_position_embeddings", 4096),
        "rope_scaling": to_dict(rope_scaling_from_hf(config)),
        "tie_embeddings": tied_embeddings(config),
    }
    try:
        cfg = build_dataclass(ModelConfig, {k: v for k, v in fields.items() if v is not None})
    except ConfigError as error:  # named as the recipe names them: name config.json's keys
        message = str(error)
        for ours, theirs in _CONFIG_KEYS.items():
            message = message.replace(f"'{ours}'", f"'{theirs}'")
        raise ConfigError(f"config.json: {message}") from None
    head_dim = config.get("head_dim")
    if head_dim is not None and head_dim != cfg.head_dim:
        raise ConfigError(f"head_dim {head_dim} is not hidden_size / num_attention_heads")
    return cfg
