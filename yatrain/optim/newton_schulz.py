"""Muon's orthogonalisation and learning-rate adjustment, step for step as ``torch.optim.Muon``.

torch keeps its Newton-Schulz iteration private (``torch.optim._muon``) and computes it in
bf16 only; this copy takes the dtype, so a run can orthogonalise in fp32. The tests compare
it with torch's own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

# Keller Jordan's quintic coefficients and torch's eps, as torch.optim.Muon uses them.
COEFFICIENTS = (3.4445, -4.7750, 2.0315)
EPS = 1e-7
ADJUST_LR = ("match_rms_adamw", "original")


def zeropower(
    matrix: torch.Tensor, steps: int, dtype: torch.dtype, *, scratch: bool = False
) -> torch.Tensor:
    """About U V^T of ``matrix`` = U S V^T, by ``steps`` quintic Newton-Schulz iterations in
    ``dtype`` (a wide matrix's Gram, so a tall one is transposed). A ``matrix`` already in
    ``dtype`` is normalised in place. ``scratch``: ``matrix`` (contiguous, in ``dtype``) is
    the caller's to spend: its memory holds every other iterate, so the iteration allocates
    one more m x n iterate and two m x m (``workspace``), and the result comes back
    contiguous in one of the two; the arithmetic is the same, op for op."""
    a, b, c = COEFFICIENTS
    if scratch and (matrix.dtype != dtype or not matrix.is_contiguous()):
        raise ValueError("zeropower's scratch matrix must be contiguous and in its dtype")
    x = matrix.to(dtype)
    tall = matrix.size(0) > matrix.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=EPS))  # spectral norm at most 1
    if scratch:
        return _iterate_in(matrix, x, steps, tall)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def _iterate_in(matrix: torch.Tensor, x: torch.Tensor, steps: int, tall: bool) -> torch.Tensor:
    """``zeropower``'s iterations with ``out=`` into two m x n iterates (``matrix``'s memory
    and one more) and one m x m Gram and update each: the same kernels as the functional
    ops, so the same bits, in 2mn + 2m^2 elements (``workspace``)."""
    a, b, c = COEFFICIENTS
    pair = [matrix.view(x.shape), torch.empty(x.shape, dtype=x.dtype, device=x.device)]
    gram = update = None
    for step in range(steps):
        gram = torch.mm(x, x.T, out=gram)
        update = torch.addmm(gram, gram, gram, beta=b, alpha=c, out=update)
        x = torch.addmm(x, update, x, beta=a, out=pair[(step + 1) % 2])
    if not tall:
        return x
    spare = pair[(steps + 1) % 2]  # the iterate before the last: free now
    return spare.view(matrix.shape).copy_(x.T)


def workspace(shape: Sequence[int]) -> int:
    """Elements ``zeropower(..., scratch=True)`` holds at once for an m x n matrix (m <= n),
    the matrix itself included: two iterates and an m x m Gram and update, 2mn + 2m^2 (for
    any ``steps`` >= 1; the norm's two scalars come and go before them)."""
    small, large = sorted((shape[0], shape[1]))
    return 2 * small * large + 2 * small * small


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
