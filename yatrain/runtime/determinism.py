"""``train.deterministic``: the same bits from the same inputs, run after run.

GPU kernels may sum in an order that changes between runs (atomics in attention's and
embedding's backward, cuBLAS split-K workspaces), so two runs of one recipe, or the engine's
two paths at world size 1, drift apart by last bits that training then amplifies. This
module asks torch for the deterministic kernels, strictly (an op without one raises instead
of warning): flash and memory-efficient attention's backwards then run their deterministic
variants. It must run before CUDA initialises, since cuBLAS reads its workspace setting
then. On a CPU the kernels are deterministic already: the setting is accepted and changes
nothing observable.
"""

from __future__ import annotations

import os

import torch

CUBLAS_WORKSPACE = ":4096:8"  # what torch's reproducibility notes ask for


def deterministic_cublas() -> None:
    """cuBLAS's deterministic workspace for this process and the ones it starts (a parent
    that spawns ranks calls this alone, keeping its own kernels as they are)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)


def set_deterministic(enabled: bool) -> None:
    """Turn deterministic kernels on (``enabled``) for this process; off leaves torch's
    defaults alone (a setting made elsewhere is kept)."""
    if not enabled:
        return
    deterministic_cublas()
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
