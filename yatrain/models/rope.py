"""Rotary position embeddings as Meta's code computes them, with Llama 3.1's scaling.

Angles are float32 whatever the compute dtype; pairs (x[2i], x[2i+1]) rotate as complex
numbers (Meta's convention; ``models.hf`` converts to Hugging Face's halves).
"""

from __future__ import annotations

import math

import torch

from yatrain.recipe.config import RopeScaling


def rope_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None, device: torch.device | str
) -> torch.Tensor:
    """The rotary inverse frequencies [head_dim // 2], with Llama 3.1's scaling when given
    (Meta's ``apply_scaling``: long wavelengths slowed by ``factor``, short ones kept, a
    smooth blend between)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    if scaling is None:
        return inv_freq
    original = scaling.original_max_position_embeddings
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / scaling.factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(medium, blended, scaled)


def rope_cos_sin(
    head_dim: int,
    seq_len: int,
    theta: float,
    device: torch.device | str,
    scaling: RopeScaling | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, [seq_len, head_dim // 2], float32 like Meta's code."""
    inv_freq = rope_frequencies(head_dim, theta, scaling, device)
    t = torch.arange(seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(t, inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs (x[2i], x[2i+1]) of x [B, T, H, D] as complex numbers by the angles
    (cos/sin [T, D/2], or [B, T, D/2] when each sequence has its own positions).

    Real arithmetic equivalent of Meta's view_as_complex(x) * polar(1, angles); done in float32.
    """
    xf = x.float().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    # [T, 1, D/2] (or per sequence [B, T, 1, D/2]) broadcasts over batch and heads
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).type_as(x)
