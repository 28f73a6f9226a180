"""Side-by-side step benchmark: the yatrain engine vs PyTorch FSDP2, DDP and a bare step.

Every contender trains the same Llama-shaped model from the same initial weights on the
same random token batches, in the same dtype, with the same activation checkpointing and
world size. Two kinds of runs, all in one invocation:

- timing: each repeat starts fresh rank processes (a new process group) that build every
  contender side by side, then step them round-robin, one step of each in turn, the order
  rotating every repeat, so that a burst of machine noise hits all of them alike. Reported
  figures are medians over all measured steps of all repeats.
- memory: each contender alone in its own fresh rank processes (warm-up + --mem-steps).

  python scripts/bench_engine.py                  # world 2, bf16 weights, fp32 reduce
  python scripts/bench_engine.py --dtype fp32     # all in fp32
  python scripts/bench_engine.py --world-size 1   # yatrain vs a bare PyTorch step
  python scripts/bench_engine.py --device cuda ...    # NCCL / CUDA (see scripts/bench_gpu.sh)

The default is the configuration GPU users run, bf16 weights with fp32 gradient reduction,
and two comparisons with FSDP2 (``fully_shard`` per layer and root, ``MixedPrecisionPolicy``,
the plain loss): the engine alone (``yatrain``: the same plain loss as FSDP2) and the
product (``yatrain-chunked``: the loss ``yatrain pretrain`` uses, the output head fused with
the cross-entropy, chunk by chunk).

What is measured, per contender:
- step time: wall time of one optimizer step (all micro-batches' forward/backward, gradient
  reduction, clipping, AdamW, zeroing), max over ranks; CUDA is synchronised around it.
- peak memory per rank, CPU: resident high-water mark (VmHWM, reset via
  /proc/self/clear_refs right before the model is built) at the end of the memory run's
  steps, minus VmRSS right before the model is built -- so weights, gradients, optimizer state,
  activations, communication buffers and allocator slack all count, for every contender
  the same way. "steps only" resets the mark after warm-up (excludes the build peak).
  CUDA: torch.cuda.max_memory_allocated / max_memory_reserved since before the build.
- optional live-tensor peak (--memtracker): torch.distributed._tools.mem_tracker.MemTracker
  over a separate short run per contender, so its overhead does not touch the timed steps.
- bytes sent per step per rank: every torch.distributed collective the contender calls is
  counted with ring accounting (bench.traffic.CommCounter), the same rule as the engine's
  own ``bytes_sent`` (which is printed alongside as a cross-check for yatrain).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from bench.engine.contenders import CONTENDERS
from bench.engine.harness import run_all
from bench.engine.report import report
from bench.measure import load_average
from yatrain.common import DTYPES
from yatrain.recipe.config import LOSS_CHUNK_TOKENS
from yatrain.runtime.determinism import deterministic_cublas


def _model_flags(add) -> None:
    """The model and batch every contender trains."""
    shape = [
        ("dim", 512),
        ("n-layers", 6),
        ("n-heads", 8),
        ("n-kv-heads", 4),
        ("ffn-dim", 1536),
        ("vocab", 8192),
        ("seq-len", 256),
    ]
    for name, default in shape:
        add(f"--{name}", type=int, default=default)
    add("--micro-batch", type=int, default=1, help="sequences per micro-batch")
    add("--accum", type=int, default=1, help="micro-batches per step per rank")
    add(
        "--dtype",
        choices=tuple(DTYPES),
        default="bf16",
        help="compute/communication dtype of weights (masters stay fp32)",
    )
    add("--reduce-dtype", choices=tuple(DTYPES), default="fp32")
    add(
        "--loss-chunk-tokens",
        type=int,
        default=LOSS_CHUNK_TOKENS,
        help="yatrain-chunked: tokens per chunk of the fused loss",
    )
    add("--ac-layers", type=int, default=0, help="activation-checkpoint the first N decoder layers")
    add("--prefetch-depth", type=int, default=1, help="yatrain prefetch depth")
    add(
        "--reduce-staging-mib",
        type=lambda text: text if text == "auto" else float(text),
        default="auto",
        help="yatrain's reduce-scatter staging budget (sharding.reduce_staging_mib)",
    )
    add(
        "--compile-backend",
        default="inductor",
        choices=("inductor", "aot_eager"),
        help="the *-compile and *-float8 contenders' torch.compile backend",
    )
    add("--seed", type=int, default=0)


def _run_flags(add) -> None:
    """How the contenders are run and measured."""
    add("--device", choices=("cpu", "cuda"), default="cpu")
    add(
        "--deterministic",
        action="store_true",
        help="deterministic kernels in every rank (train.deterministic)",
    )
    add("--world-size", type=int, default=2)
    add(
        "--contenders",
        default=None,
        help="comma list of " + ",".join(CONTENDERS) + " (default: yatrain,yatrain-chunked,"
        "fsdp2 at world > 1, yatrain,bare at world 1)",
    )
    counts = [
        ("steps", 5, "measured steps per run"),
        ("warmup", 2, "unmeasured steps per run"),
        ("mem-steps", 2, "steps after warm-up in the memory runs"),
        ("repeats", 3, "runs per contender (interleaved)"),
    ]
    for name, default, text in counts:
        add(f"--{name}", type=int, default=default, help=text)
    add(
        "--threads",
        type=int,
        default=None,
        help="torch threads per rank (default: CPU cores / world size)",
    )
    add(
        "--memtracker",
        action="store_true",
        help="also measure the live-tensor peak with MemTracker (extra short runs)",
    )
    add(
        "--profile",
        action="store_true",
        help="finally, one more side-by-side run with each "
        "contender's steps under cProfile (rank 0's profiles are printed)",
    )
    add(
        "--start-method",
        choices=("fork", "spawn"),
        default=None,
        help="how rank processes start (default: fork on CPU, spawn on CUDA)",
    )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _run_flags(p.add_argument)
    _model_flags(p.add_argument)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = _parser()
    args = p.parse_args(argv)
    if args.contenders is None:
        args.contenders = "yatrain,yatrain-chunked,fsdp2" if args.world_size > 1 else "yatrain,bare"
    args.contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    for c in args.contenders:
        if c not in CONTENDERS:
            p.error(f"unknown contender {c!r}; choose from {', '.join(CONTENDERS)}")
    if "bare" in args.contenders and args.world_size != 1:
        p.error("the bare contender is a single process: use it with --world-size 1")
    if args.ac_layers > args.n_layers:
        p.error("--ac-layers exceeds --n-layers")
    if args.dim % args.n_heads or args.n_heads % args.n_kv_heads or (args.dim // args.n_heads) % 2:
        p.error("need dim % n-heads == 0, n-heads % n-kv-heads == 0 and an even head dim")
    if args.threads is None:
        args.threads = max(1, (os.cpu_count() or 1) // args.world_size)
    if args.start_method is None:
        args.start_method = "spawn" if args.device == "cuda" else "fork"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: --device cuda needs a GPU", file=sys.stderr)
        return 1
    if args.device == "cuda" and torch.cuda.device_count() < args.world_size:
        print(f"--world-size {args.world_size} needs that many GPUs", file=sys.stderr)
        return 1
    print(
        f"bench_engine: contenders {', '.join(args.contenders)} | world {args.world_size} | "
        f"{args.device} | {args.repeats} repeats x ({args.warmup}+{args.steps}) steps | "
        f"load average {load_average()} on {os.cpu_count()} CPUs",
        flush=True,
    )
    if args.deterministic:
        deterministic_cublas()  # inherited by a spawned rank before it starts CUDA
    agg = run_all(args)
    report(args, agg)
    print(f"load average at the end: {load_average()} on {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
