"""AdamW against Muon: the step and its collectives measured side by side, Muon at scale on paper.

    python scripts/bench_optimizers.py                     # world 2 on gloo, then the paper part
    python scripts/bench_optimizers.py --repeats 5 --paper recipes/llama3_70b.yaml:256

Measured: the engine benchmark's model and flags (``bench.engine.cli``: dim 512, 6 layers,
vocab 8192, seq 256), in fp32 unless ``--dtype bf16`` and Muon's Newton-Schulz in fp32
unless ``--ns-dtype bf16`` (a CPU without bf16 matmuls takes some 100x longer in bf16).
``optim.name: adamw`` and ``muon`` each get an engine and optimizer (``run_optimizer``, what
``pretrain`` builds), built side by side in each fork-started rank and stepped round-robin
on the same batches, the order rotating every repeat. Per optimizer: the median step (max
over ranks), its parts (the loop's ``StepClock``) and the engine's collectives by kind per
step (``engine.traffic()``; Muon's all-to-alls are its ``all_to_all``), checked against the
exchange's own ``bytes_sent``.

On paper, per ``RECIPE:RANKS`` (with ``optim.name=muon``, laid out as the engine lays it):
Muon's exchange planned for every rank as a run plans it (``optim.exchange_plan``: owners by
``assign_owners`` over ``ns_cost``, buckets, HSDP split), the bytes each sends a step beside
the step's other collectives (``plan.traffic.traffic`` of the recipe with AdamW); each
owner's Newton-Schulz FLOPs, counted by torch's ``FlopCounterMode`` on ``zeropower`` over
meta tensors, and bucket after bucket (a bucket's owners start once the one before has
landed, as ``MatrixExchange.orthogonalize`` orders them: the sum of each bucket's busiest
owner) their time at an H100's dense peak (``runtime.device.PEAK_FLOPS``: 989 TFLOP/s in
bf16, the data-sheet figure MFU uses) beside the step's model FLOPs (``flops_per_token``)
at its dtype's peak. Target (issue 54): the busiest owner's FLOPs <= 1.25x the mean.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import torch.distributed as dist
from bench.engine.cli import parse_args
from bench.engine.contenders import CLIP, OPTIM, contender_recipe
from bench.engine.harness import rank_batches, rank_device
from bench.measure import load_average, median, spread, table
from bench.optimizers_paper import GPU, PAPER, on_paper, paper_tables

from yatrain.common import format_bytes
from yatrain.errors import ConfigError
from yatrain.models.loss import model_loss
from yatrain.recipe.config import OptimConfig, Recipe
from yatrain.recipe.load import load_recipe
from yatrain.runtime.process import Runtime
from yatrain.sharding.comm import KINDS
from yatrain.testing.ranks import run_ranks
from yatrain.train.build import build_model_and_engine
from yatrain.train.optim import run_optimizer
from yatrain.train.step import train_step
from yatrain.train.timing import StepClock

OPTIMIZERS = ("adamw", "muon")
# the loop's step clock (StepClock.take), rank 0's per step: Muon's Newton-Schulz is compute,
# its waits on the all-to-alls exposed communication
PARTS = ("compute s", "exposed comm s", "optimizer s")


def optim_config(name: str, o: dict) -> OptimConfig:
    """The engine benchmark's AdamW, or Muon with its defaults but ``--ns-dtype``."""
    if name == "adamw":
        return OPTIM
    return dataclasses.replace(OPTIM, name="muon", muon_ns_dtype=o["ns_dtype"])


def _bench_recipe(args: argparse.Namespace, ns_dtype: str) -> Recipe:
    """The measured shape as a Muon recipe for ``on_paper``: its global batch what the ranks
    step (``contender_recipe``'s holds no batch)."""
    recipe = contender_recipe(vars(args))
    batch = args.micro_batch * args.accum * args.world_size
    data = dataclasses.replace(recipe.data, global_batch_size=batch)
    optim = optim_config("muon", {"ns_dtype": ns_dtype})
    return dataclasses.replace(recipe, data=data, optim=optim)


def _add(total: dict, after: dict, before: dict) -> None:
    """``total`` (kind -> (collectives, bytes)) plus what was counted between two reads."""
    for kind in KINDS:
        total[kind] = tuple(
            t + a - b for t, a, b in zip(total[kind], after[kind], before[kind], strict=True)
        )


def _time_rank(rank: int, world: int, o: dict, names: list[str]) -> dict:
    """Every optimizer's engine built side by side in this rank, stepped round-robin; per
    optimizer its measured step times, their parts and the collectives by kind."""
    device = rank_device(o, rank)
    batches = rank_batches(o, rank, world, o["warmup"] + o["steps"], device)
    built = {}
    for name in names:
        model, engine = build_model_and_engine(contender_recipe(o), Runtime.of_caller_group(device))
        built[name] = (model, engine, run_optimizer(engine, model, optim_config(name, o)))
    clocks = {name: StepClock(built[name][1], device) for name in names}
    out = {name: {"times": [], "traffic": dict.fromkeys(KINDS, (0, 0))} for name in names}
    for index, micros in enumerate(batches):
        if index == o["warmup"]:
            dist.barrier()
            for clock in clocks.values():
                clock.take()  # the parts cover the measured steps only
        for name in names:
            model, engine, opt = built[name]
            before, start = engine.traffic(), time.perf_counter()
            train_step(
                model, engine, opt, micros, grad_clip=CLIP, loss_fn=model_loss, clock=clocks[name]
            )
            if index >= o["warmup"]:
                out[name]["times"].append(time.perf_counter() - start)
                _add(out[name]["traffic"], engine.traffic(), before)
    for name in names:
        out[name]["parts"] = [seconds / o["steps"] for seconds in clocks[name].take()]
        opt = built[name][2]
        dtype = getattr(opt, "ns_dtype", None)
        out[name]["exchange"] = opt.exchange.bytes_sent(dtype) if dtype else 0
    return out


def measure(args: argparse.Namespace, ns_dtype: str) -> dict[str, dict]:
    """``--repeats`` runs of fresh ranks; per optimizer the step times (max over ranks) of
    all of them, its parts, and the per-step collectives of the last run."""
    o = {k: v for k, v in vars(args).items() if k != "contenders"} | {"ns_dtype": ns_dtype}
    kw = dict(backend="gloo", threads=args.threads, start_method=args.start_method)
    names, agg = list(OPTIMIZERS), {name: {"times": [], "parts": []} for name in OPTIMIZERS}
    for repeat in range(args.repeats):
        order = names[repeat % len(names) :] + names[: repeat % len(names)]
        results = run_ranks(args.world_size, _time_rank, o, order, **kw)
        for name in names:
            per_rank = [r[name] for r in results]
            times = zip(*(r["times"] for r in per_rank), strict=True)
            agg[name]["times"] += [max(ts) for ts in times]
            agg[name]["parts"].append(per_rank[0]["parts"])  # rank 0's
            agg[name]["traffic"] = {  # the busiest rank's, per step
                kind: tuple(
                    max(r["traffic"][kind][i] for r in per_rank) // args.steps for i in (0, 1)
                )
                for kind in KINDS
            }
            agg[name]["exchange"] = max(r["exchange"] for r in per_rank)
        steps = ", ".join(f"{n} {median(agg[n]['times'][-args.steps :]):.3f}s" for n in order)
        print(f"  repeat {repeat + 1}/{args.repeats}: {steps}", flush=True)
    return agg


def measured_table(agg: dict[str, dict]) -> str:
    """One row per optimizer: its step against AdamW's, and its collectives per step."""
    headers = ["optimizer", "step s (median)", "range", "vs adamw", *PARTS]
    headers += [f"{kind} per step" for kind in KINDS] + ["all-to-all / the rest"]
    base, rows = median(agg["adamw"]["times"]), []
    for name, a in agg.items():
        sent, step = a["traffic"], median(a["times"])
        rest = sum(sent[kind][1] for kind in KINDS if kind != "all_to_all")
        cells = [f"{sent[k][0]} x, {format_bytes(sent[k][1], digits=2)}" for k in KINDS]
        parts = [f"{median(p[i] for p in a['parts']):.4f}" for i in range(len(PARTS))]
        rows.append(
            [name, f"{step:.4f}", spread(a["times"]), f"{step / base:.3f}x", *parts, *cells]
        )
        rows[-1].append(f"{sent['all_to_all'][1] / rest:.2%}")
    return table(headers, rows)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        epilog="and the engine benchmark's model and run flags: python scripts/bench_engine.py -h",
    )
    add = p.add_argument
    add("--paper", nargs="*", default=list(PAPER), metavar="RECIPE:RANKS", help="priced on paper")
    add("--set", action="append", default=[], help="an override in the paper part's recipes")
    add("--no-measure", action="store_true", help="only the paper part")
    add("--ns-dtype", choices=("bf16", "fp32"), default="fp32", help="measured Muon's")
    return p


def measured_part(args: argparse.Namespace, ns_dtype: str) -> None:
    """The side-by-side run, its table, and what the paper says of its shape."""
    print(
        f"measured: world {args.world_size}, gloo, {args.dtype} weights, {args.reduce_dtype} "
        f"reduction, dim {args.dim} x {args.n_layers} layers, vocab {args.vocab}, seq "
        f"{args.seq_len}, {args.repeats} repeats x ({args.warmup}+{args.steps}) steps, side "
        f"by side; Muon's Newton-Schulz in {ns_dtype}",
        flush=True,
    )
    agg = measure(args, ns_dtype)
    print(measured_table(agg))
    p = on_paper(_bench_recipe(args, ns_dtype), args.world_size)
    print(
        f"on paper, this shape: the largest owner's Newton-Schulz {p['flops_max'] / 1e9:.3g} "
        f"GFLOP a step, the rank's model {p['model_flops'] / 1e9:.3g} GFLOP "
        f"({p['flops_max'] / p['model_flops']:.1%})"
    )
    counted, said = agg["muon"]["traffic"]["all_to_all"][1], agg["muon"]["exchange"]
    print(
        f"Muon's all-to-all bytes per step: counted {counted:,}, its exchange's bytes_sent "
        f"{said:,}: {'equal' if counted == said else 'DIFFERENT'}"
    )


def main(argv: list[str] | None = None) -> int:
    mine, rest = _parser().parse_known_args(argv)
    # the engine benchmark's flags, fp32 unless told (CPUs without bf16 matmuls: ~100x slower)
    args = parse_args(["--dtype", "fp32", *rest, "--contenders", "yatrain"])
    print(f"bench_optimizers: load average {load_average()} on {os.cpu_count()} CPUs", flush=True)
    if not mine.no_measure:
        measured_part(args, mine.ns_dtype)
    rows = []
    for item in mine.paper:
        path, _, ranks = item.rpartition(":")
        try:
            recipe = load_recipe(path, [*mine.set, "optim.name=muon"])
            rows.append((f"{os.path.basename(path)} @ {ranks}", on_paper(recipe, int(ranks))))
        except ConfigError as refused:  # a layout a run would refuse, in one line
            print(f"bench_optimizers: {item}: {refused}", file=sys.stderr)
            return 1
    if rows:
        peak, dtype = rows[0][1]["peak"], rows[0][1]["ns_dtype"]
        print(
            f"\non paper: Newton-Schulz in {dtype} at {GPU} peak {peak / 1e12:.0f} TFLOP/s "
            "(yatrain.runtime.device.PEAK_FLOPS: data sheet, dense); bytes a rank a step"
        )
        print(paper_tables(rows))
    print(f"load average at the end: {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
