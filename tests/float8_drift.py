"""How far float8 runs that differ only in summation order drift apart: the measurement
behind tests/integration/test_float8_run.py's bounds.

    .venv/bin/python tests/float8_drift.py 30     # seeds 0-29, about 10 s each
    .venv/bin/python tests/float8_drift.py 12 two-ranks   # test_float8.py's case
    .venv/bin/python tests/float8_drift.py 12 context     # test_context_parallel_with.py's

Each seed draws the model's initial weights and the batches; on them a hybrid run (2
replicas of shard groups of 2), a flat group of 4 and one process train 6 steps in
tensorwise float8. Printed: the largest relative difference of the hybrid run's losses,
gradient norms and final weights from each of the other two, step 1 apart.
"""

from __future__ import annotations

import sys

import engine_reference as er
import torch
from distributed import run_ranks

from yatrain.sharding.groups import hybrid_mesh

STEPS, GLOBAL_BATCH = 6, 8


def four_ranks(rank, world, data, hybrid):
    """One of 4 ranks, one sequence per micro-batch, clipping at 1, float8 tensorwise."""
    args = (data, 1, 1.0, 0, "fp32", "fp32", 1, None, "tensorwise")
    return er.train_sharded(rank, world, *args, mesh=hybrid_mesh("cpu", 2) if hybrid else None)


def seeded_batches(seed: int) -> torch.Tensor:
    """``engine_reference.batches`` drawn from another generator."""
    gen = torch.Generator().manual_seed(1234 + seed)
    start = torch.randint(0, er.CFG.vocab_size, (STEPS, GLOBAL_BATCH, 1), generator=gen)
    strides = torch.randint(1, 4, (STEPS, GLOBAL_BATCH, er.SEQ), generator=gen)
    return torch.cat([start, start + strides.cumsum(-1)], dim=-1) % er.CFG.vocab_size


def drift(seed: int) -> dict[str, float]:
    er.SEED = seed  # the initial weights (read by the forked ranks too)
    data = seeded_batches(seed)
    one = er.reference(data, 1.0, 0, "tensorwise", piece=1)
    hybrid, *_ = run_ranks(4, four_ranks, data, True)
    flat, *_ = run_ranks(4, four_ranks, data, False)
    found = {}
    for name, other in (("one process", one), ("flat", flat)):
        found[f"{name} loss"] = er.max_rel(hybrid[0], other[0])
        found[f"{name} norm"] = er.max_rel(hybrid[1], other[1])
        found[f"{name} weights"] = er.weights_rel(hybrid[2], other[2])
        found[f"{name} step-1 loss"] = er.max_rel(hybrid[0][:1], other[0][:1])
        found[f"{name} step-1 norm"] = er.max_rel(hybrid[1][:1], other[1][:1])
    return found


def two_ranks_drift(seed: int, cp: int = 1) -> dict[str, float]:
    """tests/integration/test_float8.py's case: 2 ranks, two 2-sequence micro-batches each,
    10 steps, against one process on the same micro-batches, tensorwise and rowwise. With
    ``cp`` 2 (test_context_parallel_with.py's case) the 2 ranks are one CP group: each holds
    half of every window of the same four micro-batches."""
    er.SEED = seed
    gen = torch.Generator().manual_seed(1234 + seed)
    start = torch.randint(0, er.CFG.vocab_size, (er.STEPS, GLOBAL_BATCH, 1), generator=gen)
    strides = torch.randint(1, 4, (er.STEPS, GLOBAL_BATCH, er.SEQ), generator=gen)
    data = torch.cat([start, start + strides.cumsum(-1)], dim=-1) % er.CFG.vocab_size
    found = {}
    for recipe in ("tensorwise", "rowwise"):
        want = er.reference(data, 1.0, 0, recipe, piece=2)
        args = (data, 2, 1.0, 1, "fp32", "fp32", 1, None, recipe, er.CFG, cp)
        losses, norms, weights = run_ranks(2, er.train_sharded, *args)[0]
        found[f"{recipe} loss"] = er.max_rel(losses, want[0])
        found[f"{recipe} norm"] = er.max_rel(norms, want[1])
        found[f"{recipe} weights"] = er.weights_rel(weights, want[2])
        found[f"{recipe} step-1 loss"] = er.max_rel(losses[:1], want[0][:1])
        found[f"{recipe} step-1 norm"] = er.max_rel(norms[:1], want[1][:1])
    return found


def main(seeds: int, case: str = "hybrid") -> None:
    worst: dict[str, float] = {}
    for seed in range(seeds):
        if case == "hybrid":
            found = drift(seed)
        else:
            found = two_ranks_drift(seed, cp=2 if case == "context" else 1)
        print(f"seed {seed}: " + ", ".join(f"{k} {v:.2e}" for k, v in found.items()), flush=True)
        worst = {k: max(v, worst.get(k, 0.0)) for k, v in found.items()}
    print("largest: " + ", ".join(f"{k} {v:.2e}" for k, v in worst.items()))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 30, *sys.argv[2:3])
