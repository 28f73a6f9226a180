"""Where the host's time goes in the engine's buffered path: a ``torch.profiler`` summary.

The buffered path (``force_process_group``: a one-rank process group, the gather and
gradient buffers, the reduce-scatters, on CUDA the communication stream and its events) is
what every multi-GPU run takes. This traces a few of its steps after a warm-up and prints
the ops that cost the host the most (self CPU time, top 15), with the step's wall time and
the host time the profiler attributes to ops, so a slow step can be told apart as host-bound
(host time close to the wall time) or device-bound.

  python -m bench.host_profile --device cuda [model flags as bench.engine]
"""

from __future__ import annotations

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from bench.engine.cli import parse_args
from bench.engine.contenders import BUILDERS
from bench.engine.harness import rank_batches, rank_device, sync_device
from yatrain.testing.ranks import run_ranks

CONTENDER = "yatrain-pg"
TOP = 15


def _profile(rank: int, world: int, o: dict) -> dict:
    device = rank_device(o, rank)
    batches = rank_batches(o, rank, world, o["warmup"] + o["steps"], device)
    trainer = BUILDERS[CONTENDER](o, device)
    for micros in batches[: o["warmup"]]:
        trainer.step(micros)
    sync_device(device)
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for micros in batches[o["warmup"] :]:
            trainer.step(micros)
        sync_device(device)
        wall = time.perf_counter() - start
    averages = prof.key_averages()
    host_us = sum(event.self_cpu_time_total for event in averages)
    table = averages.table(sort_by="self_cpu_time_total", row_limit=TOP)
    return {"table": table, "wall_s": wall, "host_s": host_us / 1e6, "steps": o["steps"]}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args([*argv, "--world-size", "1", "--contenders", CONTENDER])
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: --device cuda needs a GPU", file=sys.stderr)
        return 1
    o = vars(args)
    backend = "nccl" if args.device == "cuda" else "gloo"
    found = run_ranks(
        1, _profile, o, backend=backend, threads=args.threads, start_method=args.start_method
    )[0]
    steps = found["steps"]
    print(
        f"host_profile: {CONTENDER} (the buffered path), {args.device}, {args.dtype} weights, "
        f"{args.reduce_dtype} reduction, {steps} profiled steps after {args.warmup}: "
        f"{found['wall_s'] / steps:.4f} s a step (profiled), host time in ops "
        f"{found['host_s'] / steps:.4f} s a step; top {TOP} ops by self CPU time:"
    )
    print(found["table"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
