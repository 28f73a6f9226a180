"""Multi-rank tests run on fork-started gloo ranks through the benchmarks' launcher."""

from __future__ import annotations

from collections.abc import Callable

from yatrain.testing.ranks import run_ranks as _run_ranks


def run_ranks(world: int, fn: Callable, *args, timeout: float = 120.0) -> list:
    """fn(rank, world, *args) on each rank, one torch thread each; results by rank."""
    return _run_ranks(world, fn, *args, timeout=timeout)
