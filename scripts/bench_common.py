"""Helpers shared by the benchmark scripts: statistics, memory readings, traffic counting,
launching ranks, the bare PyTorch baseline and table printing.

Nothing here knows about a particular contender; each benchmark script decides what to run.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing as mp
import os
import socket
import statistics
import sys
import traceback
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO))

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# ---------------------------------------------------------------------------- statistics


def median(values: Iterable[float]) -> float:
    values = list(values)
    return statistics.median(values) if values else float("nan")


def spread(values: Sequence[float]) -> str:
    """``min..max`` of a sample, for showing how noisy a median is."""
    if not values:
        return "n/a"
    return f"{min(values):.3f}..{max(values):.3f}"


# ---------------------------------------------------------------------------- CPU memory


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_bytes() -> int | None:
    """Resident set size of this process now."""
    kib = _status_kib("VmRSS")
    return None if kib is None else kib * 1024


def hwm_bytes() -> int | None:
    """Resident high-water mark since the last :func:`reset_hwm` (or process start)."""
    kib = _status_kib("VmHWM")
    return None if kib is None else kib * 1024


def trim_heap() -> None:
    """Hand free malloc memory back to the OS (glibc), so a baseline RSS is not inflated by
    what earlier, already freed allocations left behind."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)


def reset_hwm() -> bool:
    """Reset VmHWM to the current RSS (Linux: write 5 to /proc/self/clear_refs)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


# ---------------------------------------------------------------------------- traffic


class CommCounter:
    """Counts the bytes this rank sends in ``torch.distributed`` collectives.

    Wraps the module-level collective functions (the names FSDP2, DDP comm hooks and the
    yatrain engine call through ``torch.distributed``) and applies ring-algorithm
    accounting, the same as ``yatrain.sharding.comm``: an all-gather or reduce-scatter
    sends (W-1)/W of the full (unsharded) buffer, an all-reduce 2(W-1)/W of its buffer.
    This is nominal ring traffic, not what gloo puts on the wire (gloo's reduce-scatter is
    an all-reduce plus a chunk copy). Functional collectives (DTensor internals, e.g. the
    scalar norm inside ``clip_grad_norm_`` on DTensors) bypass these functions and are
    not seen; ``calls`` lists what was seen so a reader can check coverage.
    """

    GATHERS = ("all_gather_single", "all_gather_into_tensor", "_all_gather_base")
    SCATTERS = ("reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base")
    REDUCES = ("all_reduce",)

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.bytes_sent = 0
        self.calls: dict[str, int] = {}
        self._saved: dict[str, Callable] = {}

    def install(self) -> CommCounter:
        for name in (*self.GATHERS, *self.SCATTERS, *self.REDUCES):
            original = getattr(dist, name, None)
            if original is None or name in self._saved:
                continue
            self._saved[name] = original
            setattr(dist, name, self._wrap(name, original))
        return self

    def uninstall(self) -> None:
        for name, original in self._saved.items():
            setattr(dist, name, original)
        self._saved.clear()

    def _wrap(self, name: str, original: Callable) -> Callable:
        counter = self

        def wrapper(*args, **kwargs):
            counter._count(name, args, kwargs)
            return original(*args, **kwargs)

        wrapper.__wrapped__ = original  # type: ignore[attr-defined]
        return wrapper

    def _count(self, name: str, args: tuple, kwargs: dict) -> None:
        w = self.world_size
        if name in self.GATHERS:  # (output=full, input=shard)
            full = kwargs.get("output_tensor", args[0] if args else None)
            share = (w - 1) / w
        elif name in self.SCATTERS:  # (output=shard, input=full)
            full = kwargs.get("input", args[1] if len(args) > 1 else None)
            share = (w - 1) / w
        else:
            full = kwargs.get("tensor", args[0] if args else None)
            share = 2 * (w - 1) / w
        if torch.is_tensor(full):
            self.bytes_sent += int(full.numel() * full.element_size() * share)
        self.calls[name] = self.calls.get(name, 0) + 1


# ---------------------------------------------------------------------------- launching


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, world, port, backend, threads, fn, args, queue) -> None:
    try:
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
        )
        torch.set_num_threads(threads)
        if backend == "nccl":  # one GPU per rank, chosen before the group binds to one
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world)
        try:
            result = fn(rank, world, *args)
            dist.barrier()
        finally:
            dist.destroy_process_group()
        payload = io.BytesIO()
        torch.save(result, payload)
        queue.put((rank, "ok", payload.getvalue()))
    except BaseException:  # report to the parent instead of hanging it
        queue.put((rank, "error", traceback.format_exc()))


def launch(
    world: int,
    fn: Callable,
    *args,
    backend: str = "gloo",
    threads: int = 1,
    start_method: str = "fork",
    timeout: float = 900.0,
) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` fresh processes, each in a new process
    group; returns the results in rank order. ``fn`` must be a module-level function when
    ``start_method`` is ``spawn`` (needed on CUDA). Raises with the rank's traceback if any
    rank fails."""
    ctx = mp.get_context(start_method)
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, world, port, backend, threads, fn, args, queue))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    try:
        for _ in range(world):
            rank, status, payload = queue.get(timeout=timeout)
            if status != "ok":
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    return [results[r] for r in range(world)]


# ---------------------------------------------------------------------------- bare PyTorch


def decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups as the engine makes them: tensors of rank >= 2 decay, the rest do not."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def bare_adamw(groups: list[dict], lr: float, *, fused: bool = True, **kwargs):
    """Plain AdamW, fused when this build supports it for the device, else foreach."""
    if fused:
        try:
            return torch.optim.AdamW(groups, lr=lr, fused=True, **kwargs)
        except (RuntimeError, ValueError):
            pass
    return torch.optim.AdamW(groups, lr=lr, foreach=True, **kwargs)


def autocast_context(device: torch.device, dtype: torch.dtype):
    """Mixed precision the plain-PyTorch way: fp32 weights, bf16 autocast regions."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


# ---------------------------------------------------------------------------- printing


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "n/a"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub-markdown table (pastes straight into docs/benchmarks.md)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cells[0]), rule, *(line(r) for r in cells[1:])])


def load_average() -> str:
    """The 1-minute load average: how busy the machine was (other work skews timings)."""
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except OSError:
        return "n/a"


def verdict(value: float | None, limit: float, *, at_most: bool = True) -> str:
    if value is None or value != value:  # None or NaN
        return "n/a"
    ok = value <= limit if at_most else value >= limit
    return "PASS" if ok else "FAIL"
