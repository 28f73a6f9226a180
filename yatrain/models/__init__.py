"""Model definitions. Llama 2/3 is the only architecture; see llama.py."""

from yatrain.models.llama import (
    Attention,
    DecoderLayer,
    FeedForward,
    Llama,
    RMSNorm,
    build_model,
    count_parameters,
    flops_per_token,
    materialize,
)

__all__ = [
    "Attention",
    "DecoderLayer",
    "FeedForward",
    "Llama",
    "RMSNorm",
    "build_model",
    "count_parameters",
    "flops_per_token",
    "materialize",
]
