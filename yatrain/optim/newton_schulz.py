"""Muon's orthogonalisation and learning-rate adjustment, step for step as ``torch.optim.Muon``.

torch keeps its Newton-Schulz iteration private (``torch.optim._muon``) and computes it in
bf16 only; this copy takes the dtype, so a run can orthogonalise in fp32. The tests compare
it with torch's own.
"""

from __future__ import annotations

import math

import torch

# Keller Jordan's quintic coefficients and torch's eps, as torch.optim.Muon uses them.
COEFFICIENTS = (3.4445, -4.7750, 2.0315)
EPS = 1e-7
ADJUST_LR = ("match_rms_adamw", "original")


def zeropower(matrix: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """About U V^T of ``matrix`` = U S V^T, by ``steps`` quintic Newton-Schulz iterations in
    ``dtype`` (a wide matrix's Gram, so a tall one is transposed). A ``matrix`` already in
    ``dtype`` is normalised in place."""
    a, b, c = COEFFICIENTS
    x = matrix.to(dtype)
    tall = matrix.size(0) > matrix.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=EPS))  # spectral norm at most 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, rule: str, shape: torch.Size) -> float:
    """The rate a matrix of ``shape`` (rows, columns) is updated at: ``match_rms_adamw``
    (Moonshot: the update's RMS of AdamW's, so AdamW's rate and decay carry over) or
    ``original`` (Keller Jordan's)."""
    rows, cols = shape[0], shape[1]
    if rule == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    if rule == "original":
        return lr * math.sqrt(max(1, rows / cols))
    raise ValueError(f"unknown Muon learning-rate adjustment {rule!r}; use one of {ADJUST_LR}")
