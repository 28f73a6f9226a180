"""Hugging Face ``LlamaForCausalLM`` naming and layout, both ways.

Our attention uses Meta's rotary convention (rotate adjacent pairs); Hugging Face's rotates
the two halves of each head. The same model therefore stores ``wq``/``wk`` with each head's
rows permuted: ``to_hf`` applies that permutation, ``from_hf`` undoes it.
"""

from __future__ import annotations

import torch

from yatrain.common import DTYPES
from yatrain.config import ModelConfig

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


def hf_config(cfg: ModelConfig, dtype: str, bos_id: int, eos_id: int) -> dict:
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
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": str(DTYPES[dtype]).removeprefix("torch."),
    }


def model_config_from_hf(config: dict) -> ModelConfig:
    """The architecture a Hugging Face Llama ``config.json`` describes."""
    theta = config.get("rope_theta") or config.get("rope_parameters", {}).get("rope_theta", 1e4)
    return ModelConfig(
        dim=config["hidden_size"],
        n_layers=config["num_hidden_layers"],
        n_heads=config["num_attention_heads"],
        n_kv_heads=config.get("num_key_value_heads", config["num_attention_heads"]),
        ffn_dim=config["intermediate_size"],
        vocab_size=config["vocab_size"],
        rope_theta=float(theta),
        norm_eps=float(config.get("rms_norm_eps", 1e-5)),
        max_seq_len=config.get("max_position_embeddings", 4096),
    )
