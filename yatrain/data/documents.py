"""Where the documents of a packed window begin, from the tokens themselves.

Documents are stored as ``[bos] text [eos]`` back to back, so a document starts at a BOS
that follows an EOS (or at the window's first token, whatever it is). Looking at the pair
keeps this right for tokenizers whose BOS and EOS are the same token.
"""

from __future__ import annotations

import torch


def document_layout(
    tokens: torch.Tensor, bos_id: int, eos_id: int, restart_positions: bool = False
) -> dict[str, torch.Tensor]:
    """``document_ids`` [B, T] (equal within a document, increasing along a window) and,
    with ``restart_positions``, ``positions`` [B, T] counting from 0 in each document."""
    starts = torch.zeros_like(tokens, dtype=torch.bool)
    starts[:, 0] = True
    starts[:, 1:] = (tokens[:, 1:] == bos_id) & (tokens[:, :-1] == eos_id)
    out = {"document_ids": starts.cumsum(dim=1)}
    if restart_positions:
        index = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
        out["positions"] = index - first
    return out
