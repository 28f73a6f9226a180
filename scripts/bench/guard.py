"""What the checks around an update cost: the non-finite weight check against a whole step.

    python -m bench.guard recipes/tiny.yaml --steps 20

One process, the recipe's model on this machine's device, synthetic tokens. Each step runs
``train_step`` with the guard (which includes the weight check after the update); the check
itself (one sum over each flat shard and the flag's all-reduce) is also timed on its own,
right after, on the same weights. Prints medians and the check's share of a step, beside
what an element-wise ``isfinite().all()`` over the same shards would cost.
"""

from __future__ import annotations

import argparse
import functools
import time

import torch

from bench.measure import load_average, median
from yatrain.recipe.load import load_recipe
from yatrain.runtime.device import synchronize
from yatrain.runtime.process import init_runtime
from yatrain.train.build import build_model_and_engine
from yatrain.train.guard import StepGuard
from yatrain.train.optim import build_optimizer
from yatrain.train.step import train_step


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe")
    parser.add_argument("--set", action="append", default=[], dest="overrides")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    cfg = load_recipe(args.recipe, args.overrides)
    runtime = init_runtime()
    device = runtime.device
    model, engine = build_model_and_engine(cfg, runtime, say=print)
    optimizer = build_optimizer(engine.param_groups(0.1), cfg.optim)
    guard = StepGuard(device)
    shards = [p for group in optimizer.param_groups for p in group["params"]]
    micro, seq = cfg.data.micro_batch_size, cfg.data.seq_len
    accum = cfg.data.global_batch_size // micro
    steps, checks, elementwise = [], [], []
    for _ in range(args.steps):
        tokens = torch.randint(0, cfg.model.vocab_size, (accum, micro, seq + 1))
        batches = [(t[:, :-1], t[:, 1:]) for t in tokens]
        run_step = functools.partial(
            train_step, model, engine, optimizer, batches, grad_clip=1.0, guard=guard
        )
        steps.append(_timed(device, run_step))
        checks.append(_timed(device, lambda: guard.weights_finite(shards)))
        elementwise.append(
            _timed(device, lambda: all(bool(torch.isfinite(p).all()) for p in shards))
        )
    guard.restore()
    step, check, full = median(steps[2:]), median(checks[2:]), median(elementwise[2:])
    print(f"{args.recipe} {' '.join(args.overrides)} on {device}, load {load_average()}")
    print(
        f"step (with the check): {step * 1e3:.1f} ms; weight check {check * 1e3:.3f} ms = "
        f"{check / step:.3%} of a step; isfinite().all() {full * 1e3:.3f} ms = "
        f"{full / step:.2%}"
    )


def _timed(device: torch.device, fn) -> float:
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
