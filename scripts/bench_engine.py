"""Side-by-side step benchmark: the yatrain engine vs PyTorch FSDP2, DDP and a bare step.

Every contender trains the same Llama-shaped model from the same initial weights on the
same random token batches, in the same dtype, with the same activation checkpointing and
world size. Two kinds of runs, all in one invocation:

- timing: each repeat starts fresh rank processes (a new process group) that build every
  contender side by side, then step them round-robin, one step of each in turn, the order
  rotating every repeat, so that a burst of machine noise hits all of them alike. Reported
  figures are medians over all measured steps of all repeats.
- memory: each contender alone in its own fresh rank processes (warm-up + --mem-steps).

  python scripts/bench_engine.py                      # world 2 on gloo: yatrain, fsdp2, ddp
  python scripts/bench_engine.py --world-size 1       # yatrain vs a bare PyTorch step
  python scripts/bench_engine.py --device cuda ...    # NCCL / CUDA (see scripts/bench_gpu.sh)

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
  counted with ring accounting (bench_common.CommCounter), the same rule as the engine's
  own ``bytes_sent`` (which is printed alongside as a cross-check for yatrain).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import io
import os
import pstats
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_common import (  # noqa: E402
    DTYPES,
    CommCounter,
    autocast_context,
    bare_adamw,
    decay_groups,
    fmt_bytes,
    hwm_bytes,
    launch,
    load_average,
    median,
    reset_hwm,
    rss_bytes,
    spread,
    table,
    trim_heap,
    verdict,
)

from yatrain.config import ModelConfig, OptimConfig  # noqa: E402
from yatrain.models.llama import (  # noqa: E402
    build_model,
    count_parameters,
    flops_per_token,
    materialize,
)
from yatrain.sharding.engine import ShardedEngine  # noqa: E402
from yatrain.train.optim import build_optimizer  # noqa: E402

# Everything a contender needs is imported here, before ranks start, so that module import
# does not land inside one contender's memory measurement and build time.

CONTENDERS = ("yatrain", "fsdp2", "ddp", "bare")
LR, WEIGHT_DECAY, BETAS, EPS, CLIP = 3e-4, 0.1, (0.9, 0.95), 1e-8, 1.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument(
        "--contenders",
        default=None,
        help="comma list of yatrain,fsdp2,ddp,bare (default: yatrain,fsdp2,ddp at "
        "world > 1, yatrain,bare at world 1)",
    )
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--n-layers", type=int, default=6)
    p.add_argument("--n-heads", type=int, default=8)
    p.add_argument("--n-kv-heads", type=int, default=4)
    p.add_argument("--ffn-dim", type=int, default=1536)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per step per rank")
    p.add_argument(
        "--dtype",
        choices=tuple(DTYPES),
        default="fp32",
        help="compute/communication dtype of weights (masters stay fp32)",
    )
    p.add_argument("--reduce-dtype", choices=tuple(DTYPES), default="fp32")
    p.add_argument(
        "--ac-layers", type=int, default=0, help="activation-checkpoint the first N decoder layers"
    )
    p.add_argument("--prefetch-depth", type=int, default=1, help="yatrain prefetch depth")
    p.add_argument("--steps", type=int, default=5, help="measured steps per run")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured steps per run")
    p.add_argument(
        "--mem-steps", type=int, default=2, help="steps after warm-up in the memory runs"
    )
    p.add_argument("--repeats", type=int, default=3, help="runs per contender (interleaved)")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads per rank (default: CPU cores / world size)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--memtracker",
        action="store_true",
        help="also measure the live-tensor peak with MemTracker (extra short runs)",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="finally, one more side-by-side run with each contender's steps under cProfile "
        "(rank 0's profiles are printed)",
    )
    p.add_argument(
        "--start-method",
        choices=("fork", "spawn"),
        default=None,
        help="how rank processes start (default: fork on CPU, spawn on CUDA)",
    )
    args = p.parse_args(argv)
    if args.contenders is None:
        args.contenders = "yatrain,fsdp2,ddp" if args.world_size > 1 else "yatrain,bare"
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


def model_config(o: dict) -> ModelConfig:
    return ModelConfig(
        dim=o["dim"],
        n_layers=o["n_layers"],
        n_heads=o["n_heads"],
        n_kv_heads=o["n_kv_heads"],
        ffn_dim=o["ffn_dim"],
        vocab_size=o["vocab"],
        max_seq_len=o["seq_len"],
    )


def rank_batches(o: dict, rank: int, world: int, n_steps: int, device) -> list[list]:
    """Random tokens from one fixed generator: the same global batches for every contender.
    Step s, rank r gets micro-batches [(x, y)] * accum cut from the global batch."""
    gen = torch.Generator().manual_seed(o["seed"] + 12345)
    shape = (n_steps, world, o["accum"], o["micro_batch"], o["seq_len"] + 1)
    tokens = torch.randint(0, o["vocab"], shape, generator=gen)
    steps = []
    for s in range(n_steps):
        micros = []
        for a in range(o["accum"]):
            seq = tokens[s, rank, a].to(device)
            micros.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
        steps.append(micros)
    return steps


# ---------------------------------------------------------------------------- contenders


@dataclass
class Trainer:
    step: object  # callable(micro_batches) -> detached mean loss tensor
    engine_bytes: object = None  # callable() -> int, the engine's own counter (yatrain)
    extra: dict | None = None


def _xent(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def build_yatrain(o: dict, device: torch.device) -> Trainer:
    cfg = model_config(o)
    model = build_model(cfg, o["ac_layers"])
    seed = o["seed"]
    engine = ShardedEngine(
        model,
        model.units(),
        model.norm_modules(),
        init_unit=lambda i: model.init_unit_(i, seed),
        init_norms=model.init_norms_,
        device=device,
        param_dtype=DTYPES[o["dtype"]],
        reduce_dtype=DTYPES[o["reduce_dtype"]],
        prefetch_depth=o["prefetch_depth"],
    )
    optim_cfg = OptimConfig(
        lr=LR, weight_decay=WEIGHT_DECAY, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, grad_clip=CLIP
    )
    opt = build_optimizer(engine.param_groups(WEIGHT_DECAY), optim_cfg)

    def step(micros):
        total = torch.zeros((), device=device)
        for x, y in micros:
            loss = _xent(model(x), y)
            loss.backward()
            total += loss.detach()
        engine.reduce_gradients()
        engine.clip_grad_norm_(CLIP)
        opt.step()
        engine.after_step()
        return total / len(micros)

    return Trainer(
        step,
        engine_bytes=lambda: engine.bytes_sent,
        extra={"optimizer": type(opt).__name__ + _opt_kind(opt)},
    )


def build_fsdp2(o: dict, device: torch.device) -> Trainer:
    model = materialize(build_model(model_config(o), o["ac_layers"]), device, o["seed"])
    policy = MixedPrecisionPolicy(
        param_dtype=DTYPES[o["dtype"]], reduce_dtype=DTYPES[o["reduce_dtype"]]
    )
    for layer in model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    opt = torch.optim.AdamW(
        decay_groups(model, WEIGHT_DECAY), lr=LR, betas=BETAS, eps=EPS, foreach=True
    )
    params = list(model.parameters())

    def step(micros):
        total = torch.zeros((), device=device)
        for x, y in micros:  # reduce-scatters every micro-batch, like the engine
            loss = _xent(model(x), y)
            (loss / len(micros)).backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(params, CLIP, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total / len(micros)

    return Trainer(step, extra={"optimizer": "AdamW(foreach)"})


def _ddp_allreduce_hook(state, bucket):
    """DDP's default averaging all-reduce, issued through torch.distributed so it is counted."""
    buf = bucket.buffer()
    buf.div_(dist.get_world_size())
    work = dist.all_reduce(buf, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def _replicated_trainer(model, run, device: torch.device, cast, no_sync=None) -> Trainer:
    """Step of a replicated model (bare or DDP): the same AdamW, clipping and averaging;
    ``no_sync`` (DDP) skips the all-reduce on all but the last micro-batch."""
    opt = bare_adamw(decay_groups(model, WEIGHT_DECAY), LR, betas=BETAS, eps=EPS)
    params = list(model.parameters())

    def step(micros):
        total = torch.zeros((), device=device)
        for i, (x, y) in enumerate(micros):
            defer = no_sync is not None and i < len(micros) - 1
            with no_sync() if defer else contextlib.nullcontext():
                with autocast_context(device, cast):
                    loss = _xent(run(x), y)
                (loss / len(micros)).backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(params, CLIP, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total / len(micros)

    return Trainer(step, extra={"optimizer": "AdamW" + _opt_kind(opt)})


def build_ddp(o: dict, device: torch.device) -> Trainer:
    model = materialize(build_model(model_config(o), o["ac_layers"]), device, o["seed"])
    ids = [device.index] if device.type == "cuda" else None
    ddp = DistributedDataParallel(model, device_ids=ids)
    ddp.register_comm_hook(None, _ddp_allreduce_hook)
    return _replicated_trainer(model, ddp, device, DTYPES[o["dtype"]], no_sync=ddp.no_sync)


def build_bare(o: dict, device: torch.device) -> Trainer:
    model = materialize(build_model(model_config(o), o["ac_layers"]), device, o["seed"])
    return _replicated_trainer(model, model, device, DTYPES[o["dtype"]])


BUILDERS = {"yatrain": build_yatrain, "fsdp2": build_fsdp2, "ddp": build_ddp, "bare": build_bare}


def _opt_kind(opt: torch.optim.Optimizer) -> str:
    d = opt.defaults
    return "(fused)" if d.get("fused") else "(foreach)" if d.get("foreach") else ""


# ---------------------------------------------------------------------------- one rank


def _device(o: dict, rank: int) -> torch.device:
    if o["device"] == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_rank(rank: int, world: int, o: dict, names: list[str], profile: bool = False) -> dict:
    """Timing run: every contender built side by side in this rank's process, then stepped
    round-robin (one step of each in turn), so a burst of machine noise hits all alike.
    Also counts bytes per step (counter deltas around each contender's own steps). With
    ``profile``, each contender's measured steps run under its own cProfile (a separate,
    untimed run: the profiler slows Python-heavy code more)."""
    device = _device(o, rank)
    counter = CommCounter(world).install()
    batches = rank_batches(o, rank, world, o["warmup"] + o["steps"], device)
    trainers, out = {}, {}
    for name in names:
        t0 = time.perf_counter()
        trainers[name] = BUILDERS[name](o, device)
        _sync(device)
        out[name] = {
            "build_s": time.perf_counter() - t0,
            "times": [],
            "bytes": 0,
            "engine": 0,
            "calls": {},
        }
    losses = {}
    profilers = {name: cProfile.Profile() for name in names} if profile else {}
    for index, micros in enumerate(batches):
        measured = index >= o["warmup"]
        if index == o["warmup"]:
            dist.barrier()
        for name in names:
            trainer, res = trainers[name], out[name]
            bytes0, calls0 = counter.bytes_sent, dict(counter.calls)
            engine0 = trainer.engine_bytes() if trainer.engine_bytes else 0
            _sync(device)
            prof = profilers.get(name) if measured else None
            if prof:
                prof.enable()
            start = time.perf_counter()
            losses[name] = trainer.step(micros)
            _sync(device)
            if prof:
                prof.disable()
            if measured:
                res["times"].append(time.perf_counter() - start)
                res["bytes"] += counter.bytes_sent - bytes0
                if trainer.engine_bytes:
                    res["engine"] += trainer.engine_bytes() - engine0
                for fn, count in counter.calls.items():
                    delta = count - calls0.get(fn, 0)
                    if delta:
                        res["calls"][fn] = res["calls"].get(fn, 0) + delta
    for name in names:
        res, trainer = out[name], trainers[name]
        steps = max(len(res["times"]), 1)
        res["bytes_per_step"] = res.pop("bytes") / steps
        engine = res.pop("engine")
        res["engine_bytes_per_step"] = engine / steps if trainer.engine_bytes else None
        res["loss"] = float(losses[name])
        res["extra"] = trainer.extra or {}
        if name in profilers:
            text = io.StringIO()
            pstats.Stats(profilers[name], stream=text).sort_stats("tottime").print_stats(25)
            res["profile"] = text.getvalue()
    return out


def memory_rank(rank: int, world: int, o: dict, name: str, mode: str) -> dict:
    """One contender alone in fresh processes. mode 'memory': the peak-memory measurement
    (module docstring) over warm-up + --mem-steps steps; 'memtracker': MemTracker's
    live-tensor peak over a build and two steps."""
    device = _device(o, rank)
    batches = rank_batches(o, rank, world, o["warmup"] + o["mem_steps"], device)
    gc.collect()
    _sync(device)
    if mode == "memtracker":
        return _memtracker_run(o, name, device, batches)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    trim_heap()
    reset_hwm()
    base = rss_bytes()
    trainer = BUILDERS[name](o, device)
    for micros in batches[: o["warmup"]]:
        trainer.step(micros)
    _sync(device)
    hwm_warm = hwm_bytes()
    reset_hwm()
    dist.barrier()
    for micros in batches[o["warmup"] :]:
        trainer.step(micros)
    _sync(device)
    result: dict = {}
    if device.type == "cuda":
        result["mem_alloc"] = torch.cuda.max_memory_allocated(device)
        result["mem_reserved"] = torch.cuda.max_memory_reserved(device)
    hwm_steps = hwm_bytes()
    if base is not None and hwm_steps is not None and hwm_warm is not None:
        result["mem"] = max(hwm_warm, hwm_steps) - base
        result["mem_steps"] = hwm_steps - base
    return result


def _memtracker_run(o: dict, name: str, device: torch.device, batches) -> dict:
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    with tracker:
        trainer = BUILDERS[name](o, device)
        for micros in batches[:2]:  # the second step sees the optimizer state
            trainer.step(micros)
            tracker.reset_mod_stats()  # per-module stats only; the global peak stays
    peak = tracker.get_tracker_snapshot("peak")
    stats = peak.get(device) or next(iter(peak.values()), {})
    return {"live_peak": stats.get("Total"), "live_breakdown": dict(stats)}


# ---------------------------------------------------------------------------- driver


def run_all(args: argparse.Namespace) -> dict[str, dict]:
    o = {k: v for k, v in vars(args).items() if k not in ("contenders",)}
    kw = dict(
        backend="nccl" if args.device == "cuda" else "gloo",
        threads=args.threads,
        start_method=args.start_method,
    )
    agg: dict[str, dict] = {
        c: {"times": [], "bytes": [], "engine_bytes": [], "loss": [], "build": [], "calls": {}}
        for c in args.contenders
    }
    order = list(args.contenders)
    print("timing: all contenders side by side in each rank, one step of each in turn")
    for r in range(args.repeats):
        rotated = order[r % len(order) :] + order[: r % len(order)]
        t0 = time.perf_counter()
        results = launch(args.world_size, time_rank, o, rotated, **kw)
        for name in rotated:
            a, per_rank = agg[name], [res[name] for res in results]
            per_step = [max(ts) for ts in zip(*(x["times"] for x in per_rank), strict=True)]
            a["times"] += per_step
            a["build"].append(max(x["build_s"] for x in per_rank))
            a["bytes"].append(per_rank[0]["bytes_per_step"])
            if per_rank[0]["engine_bytes_per_step"] is not None:
                a["engine_bytes"].append(per_rank[0]["engine_bytes_per_step"])
            a["loss"].append(sum(x["loss"] for x in per_rank) / len(per_rank))
            a["extra"] = per_rank[0]["extra"]
            steps = max(len(per_step), 1)
            a["calls"] = {fn: n / steps for fn, n in per_rank[0]["calls"].items()}
        summary = ", ".join(f"{n} {median(agg[n]['times'][-args.steps :]):.3f}s" for n in rotated)
        print(
            f"  repeat {r + 1}/{args.repeats} (order {','.join(rotated)}): median step {summary} "
            f"[{time.perf_counter() - t0:.1f}s incl. start/build]",
            flush=True,
        )

    print(f"memory: each contender alone in fresh ranks, {args.warmup}+{args.mem_steps} steps")
    for name in order:
        results = launch(args.world_size, memory_rank, o, name, "memory", **kw)
        a = agg[name]
        for key in ("mem", "mem_steps", "mem_alloc", "mem_reserved"):
            if key in results[0]:
                a[key] = max(res[key] for res in results)
        shown = fmt_bytes(a.get("mem_alloc", a.get("mem")))
        print(f"  {name:8s} peak {shown}/rank", flush=True)
    if args.memtracker:
        for name in order:
            results = launch(args.world_size, memory_rank, o, name, "memtracker", **kw)
            agg[name]["live_peak"] = max((res["live_peak"] or 0) for res in results)
            agg[name]["live_breakdown"] = results[0]["live_breakdown"]
            print(f"  {name:8s} MemTracker live-tensor peak {fmt_bytes(agg[name]['live_peak'])}")
    if args.profile:
        results = launch(args.world_size, time_rank, o, order, True, **kw)
        for name in order:
            print(f"\n== cProfile of {name}, rank 0, {args.steps} steps, side by side ==")
            print(results[0][name]["profile"])
    return agg


def report(args: argparse.Namespace, agg: dict[str, dict]) -> None:
    cfg = model_config(vars(args))
    tokens = args.world_size * args.accum * args.micro_batch * args.seq_len
    cuda = args.device == "cuda"
    peak, peak_src = _peak_flops(args)
    fpt = flops_per_token(cfg, args.seq_len)
    med = {c: median(a["times"]) for c, a in agg.items()}
    mem = {c: a.get("mem_alloc" if cuda else "mem") for c, a in agg.items()}
    ref = "fsdp2" if "fsdp2" in agg else ("bare" if "bare" in agg else None)

    headers = ["contender", "median step s", "step range s", "tokens/s (global)", "MFU"]
    if cuda:
        headers += ["peak alloc/rank", "peak reserved/rank"]
    else:
        headers += ["peak mem/rank", "(steps only)"]
    if args.memtracker:
        headers += ["live-tensor peak"]
    headers += ["bytes sent/step/rank", "final loss"]
    if ref:
        headers += [f"step vs {ref}", f"mem vs {ref}"]
    rows = []
    for c, a in agg.items():
        t = med[c]
        row = [c, f"{t:.3f}", spread(a["times"]), f"{tokens / t:,.0f}"]
        row.append(f"{tokens / args.world_size / t * fpt / peak:.1%}")
        if cuda:
            row += [fmt_bytes(mem[c]), fmt_bytes(a.get("mem_reserved"))]
        else:
            row += [fmt_bytes(mem[c]), fmt_bytes(a.get("mem_steps"))]
        if args.memtracker:
            row.append(fmt_bytes(a.get("live_peak")))
        row.append(fmt_bytes(median(a["bytes"])) if args.world_size > 1 else "0 (1 rank)")
        row.append(f"{median(a['loss']):.5f}")
        if ref:
            row.append(f"{t / med[ref]:.3f}x")
            row.append(f"{mem[c] / mem[ref]:.3f}x" if mem[c] and mem[ref] else "n/a")
        rows.append(row)
    n_params = count_parameters(cfg)
    print()
    print(
        f"model: dim {cfg.dim}, {cfg.n_layers} layers, {cfg.n_heads} heads / {cfg.n_kv_heads} kv, "
        f"ffn {cfg.ffn_dim}, vocab {cfg.vocab_size}: {n_params / 1e6:.2f}M params "
        f"({n_params * 4 / 2**20:.0f} MiB fp32); seq {args.seq_len}, micro-batch "
        f"{args.micro_batch} x accum {args.accum} per rank, {tokens} tokens/step; dtype "
        f"{args.dtype}, reduce {args.reduce_dtype}, AC layers {args.ac_layers}"
    )
    print(
        f"run: {args.device}, world {args.world_size} ({'nccl' if cuda else 'gloo'}), "
        f"{args.threads} thread(s)/rank, {args.repeats} repeats x ({args.warmup} warm-up + "
        f"{args.steps} measured) steps of each contender, round-robin; torch "
        f"{torch.__version__}; MFU vs {peak / 1e12:.3g} TFLOP/s ({peak_src})"
    )
    for c, a in agg.items():
        calls = ", ".join(f"{k} x{v:g}" for k, v in sorted(a["calls"].items())) or "none"
        note = f"  {c}: {a['extra'].get('optimizer', '')}; collectives per step: {calls}"
        if a["engine_bytes"]:
            note += f"; engine.bytes_sent/step {fmt_bytes(median(a['engine_bytes']))}"
        note += f"; build {median(a['build']):.2f}s"
        print(note)
        if a.get("live_breakdown"):
            parts = ", ".join(
                f"{getattr(k, 'name', k)} {fmt_bytes(v)}"
                for k, v in a["live_breakdown"].items()
                if v
            )
            print(f"    MemTracker peak: {parts}")
    print()
    print(table(headers, rows))
    print()
    _targets(args, med, mem)


def _targets(args, med, mem) -> None:
    checks = []
    if "yatrain" in med and "fsdp2" in med and args.world_size > 1:
        r = med["yatrain"] / med["fsdp2"]
        checks.append(("yatrain step time <= 0.80x FSDP2", f"{r:.3f}x", verdict(r, 0.80)))
        if mem["yatrain"] and mem["fsdp2"]:
            m = mem["yatrain"] / mem["fsdp2"]
            checks.append(("yatrain peak memory <= FSDP2", f"{m:.3f}x", verdict(m, 1.0)))
    if "yatrain" in med and "bare" in med:
        r = med["yatrain"] / med["bare"]
        checks.append(("world 1: yatrain step time <= 1.05x bare", f"{r:.3f}x", verdict(r, 1.05)))
    if checks:
        print(table(["target", "measured", "result"], checks))


def _peak_flops(args) -> tuple[float, str]:
    if args.device == "cuda":
        from yatrain.train.metrics import peak_flops

        if torch.cuda.is_available():
            return peak_flops(torch.device("cuda", 0), args.dtype)
    torch.set_num_threads(args.threads)  # the per-rank thread budget
    from yatrain.train.metrics import measure_matmul_flops

    return measure_matmul_flops(
        torch.device("cpu"), args.dtype
    ), f"measured cpu matmul, {args.threads} thread(s)"


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
    agg = run_all(args)
    report(args, agg)
    print(f"load average at the end: {load_average()} on {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
