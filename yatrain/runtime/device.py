"""What this device can do and has used: its dense peak FLOP/s (for MFU), a sync, and its peak
memory since the last read.

The peak is a published figure for known GPUs and a figure MEASURED here for the rest (a square
matmul in the training dtype), labelled as such, so MFU never rests on a guess. Peak memory: on
CUDA the caching allocator's ``max_memory_allocated`` since the last read; on CPU the process's
resident high-water mark (``VmHWM`` in ``/proc/self/status``, reset at each read via
``/proc/self/clear_refs``), which includes the interpreter and libraries, so it overstates
tensor memory; it is null where the platform offers neither.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch

from yatrain.common import DTYPES

# Dense peak FLOP/s per device (vendor data sheets, SXM parts, no sparsity).
PEAK_FLOPS = {
    "A100": {"bf16": 312e12, "fp32": 19.5e12},
    "H100": {"bf16": 989e12, "fp32": 67e12},
    "H200": {"bf16": 989e12, "fp32": 67e12},
}


def peak_flops(device: torch.device, dtype: str) -> tuple[float, str]:
    """(peak FLOP/s, where the figure comes from) for MFU."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, table in PEAK_FLOPS.items():
            if key in name:
                return table[dtype], f"data sheet ({key} {dtype})"
        return measure_matmul_flops(device, dtype), f"measured matmul ({name} {dtype})"
    return measure_matmul_flops(device, dtype), f"measured matmul (cpu {dtype})"


def measure_matmul_flops(
    device: torch.device, dtype: str, size: int = 1024, trials: int = 12, budget_s: float = 2.0
) -> float:
    """Best of several square matmuls: the practical peak of this device in this dtype.

    Taking the best (not the mean) keeps a busy neighbour from lowering the peak, which
    would inflate MFU; on a machine that stays loaded it still reads low. No trial starts
    after ``budget_s``: a CPU without bf16 units takes seconds a matmul (12 of them held a
    CPU run, or a dry run, for a minute and a half before its first step)."""
    a = torch.randn(size, size, device=device, dtype=DTYPES[dtype])
    b = torch.randn(size, size, device=device, dtype=DTYPES[dtype])
    best = float("inf")
    began = time.perf_counter()
    for _ in range(trials):
        synchronize(device)
        start = time.perf_counter()
        a @ b
        synchronize(device)
        best = min(best, time.perf_counter() - start)
        if time.perf_counter() - began > budget_s:
            break
    return 2 * size**3 / best


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class PeakMemory:
    """Peak memory since the last ``read()`` (see module docstring for the method)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.method = "cuda max_memory_allocated" if device.type == "cuda" else "process VmHWM"
        self.reset()

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        # Where this fails the figure is the high-water mark since process start.
        with contextlib.suppress(OSError):
            Path("/proc/self/clear_refs").write_text("5")

    def read(self) -> int | None:
        if self.device.type == "cuda":
            value = torch.cuda.max_memory_allocated(self.device)
        else:
            value = _vm_hwm_bytes()
        self.reset()
        return value


def _vm_hwm_bytes() -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
