"""The engine benchmark's harness: what each rank runs, and how repeats are aggregated.

- timing: each repeat starts fresh rank processes (a new process group) that build every
  contender side by side, then step them round-robin, one step of each in turn, the order
  rotating every repeat, so that a burst of machine noise hits all of them alike.
- memory: each contender alone in its own fresh rank processes (warm-up + ``--mem-steps``):
  resident high-water mark (VmHWM, reset right before the model is built) minus VmRSS right
  before the build; on CUDA the allocator's peaks. ``--memtracker`` adds MemTracker's
  live-tensor peak over a separate short run.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import time

import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker

from bench.engine.contenders import BUILDERS, Trainer
from bench.measure import hwm_bytes, median, reset_hwm, rss_bytes, trim_heap
from bench.traffic import CommCounter
from yatrain.common import format_bytes
from yatrain.runtime.determinism import set_deterministic
from yatrain.testing.ranks import run_ranks


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


def rank_device(o: dict, rank: int) -> torch.device:
    """This rank's device, with deterministic kernels when ``--deterministic`` asks."""
    set_deterministic(o["deterministic"])
    if o["device"] == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def sync_device(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA; a CPU has none), so a clock sees it done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------- one rank


def _timed_step(
    trainer: Trainer,
    res: dict,
    micros,
    counter: CommCounter,
    device,
    measured: bool,
    prof: cProfile.Profile | None,
):
    """One step of one contender; when ``measured``, its time, bytes and calls go in ``res``."""
    bytes0, calls0 = counter.bytes_sent, dict(counter.calls)
    engine0 = trainer.engine_bytes() if trainer.engine_bytes else 0
    sync_device(device)
    if prof:
        prof.enable()
    start = time.perf_counter()
    loss = trainer.step(micros)
    sync_device(device)
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
    return loss


def _per_step(res: dict, trainer: Trainer, loss, prof: cProfile.Profile | None) -> dict:
    steps = max(len(res["times"]), 1)
    res["bytes_per_step"] = res.pop("bytes") / steps
    engine = res.pop("engine")
    res["engine_bytes_per_step"] = engine / steps if trainer.engine_bytes else None
    res["loss"] = float(loss)
    res["extra"] = trainer.extra
    if trainer.clock is not None:  # (compute, exposed communication, optimizer) per step
        res["breakdown"] = [seconds / steps for seconds in trainer.clock.take()]
    if prof is not None:
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
        res["profile"] = text.getvalue()
    return res


def time_rank(rank: int, world: int, o: dict, names: list[str], profile: bool = False) -> dict:
    """Timing run: every contender built side by side in this rank's process, then stepped
    round-robin (one step of each in turn), so a burst of machine noise hits all alike.
    Also counts bytes per step (counter deltas around each contender's own steps). With
    ``profile``, each contender's measured steps run under its own cProfile (a separate,
    untimed run: the profiler slows Python-heavy code more)."""
    device = rank_device(o, rank)
    counter = CommCounter(world).install()
    batches = rank_batches(o, rank, world, o["warmup"] + o["steps"], device)
    trainers, out = {}, {}
    for name in names:
        t0 = time.perf_counter()
        trainers[name] = BUILDERS[name](o, device)
        sync_device(device)
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
            for trainer in trainers.values():
                if trainer.clock is not None:
                    sync_device(device)
                    trainer.clock.take()  # the breakdown covers the measured steps only
        for name in names:
            prof = profilers.get(name) if measured else None
            losses[name] = _timed_step(
                trainers[name], out[name], micros, counter, device, measured, prof
            )
    return {
        name: _per_step(out[name], trainers[name], losses[name], profilers.get(name))
        for name in names
    }


def memory_rank(rank: int, world: int, o: dict, name: str, mode: str) -> dict:
    """One contender alone in fresh processes. mode 'memory': the peak-memory measurement
    (module docstring) over warm-up + --mem-steps steps; 'memtracker': MemTracker's
    live-tensor peak over a build and two steps."""
    device = rank_device(o, rank)
    batches = rank_batches(o, rank, world, o["warmup"] + o["mem_steps"], device)
    gc.collect()
    sync_device(device)
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
    sync_device(device)
    hwm_warm = hwm_bytes()
    reset_hwm()
    dist.barrier()
    for micros in batches[o["warmup"] :]:
        trainer.step(micros)
    sync_device(device)
    result: dict = {}
    if device.type == "cuda":
        result["mem_alloc"] = torch.cuda.max_memory_allocated(device)
        result["mem_reserved"] = torch.cuda.max_memory_reserved(device)
        free, total = torch.cuda.mem_get_info(device)  # + the CUDA context and NCCL's buffers
        result["device_used"] = total - free
    hwm_steps = hwm_bytes()
    if base is not None and hwm_steps is not None and hwm_warm is not None:
        result["mem"] = max(hwm_warm, hwm_steps) - base
        result["mem_steps"] = hwm_steps - base
    return result


def _memtracker_run(o: dict, name: str, device: torch.device, batches) -> dict:
    tracker = MemTracker()
    with tracker:
        trainer = BUILDERS[name](o, device)
        for micros in batches[:2]:  # the second step sees the optimizer state
            trainer.step(micros)
            tracker.reset_mod_stats()  # per-module stats only; the global peak stays
    peak = tracker.get_tracker_snapshot("peak")
    stats = peak.get(device) or next(iter(peak.values()), {})
    return {"live_peak": stats.get("Total"), "live_breakdown": dict(stats)}


# ---------------------------------------------------------------------------- all repeats


def _add_repeat(a: dict, per_rank: list[dict]) -> None:
    """Fold one repeat's per-rank results for one contender into its aggregate."""
    per_step = [max(ts) for ts in zip(*(x["times"] for x in per_rank), strict=True)]
    a["times"] += per_step
    a["build"].append(max(x["build_s"] for x in per_rank))
    a["bytes"].append(per_rank[0]["bytes_per_step"])
    if per_rank[0]["engine_bytes_per_step"] is not None:
        a["engine_bytes"].append(per_rank[0]["engine_bytes_per_step"])
    a["loss"].append(sum(x["loss"] for x in per_rank) / len(per_rank))
    a["extra"] = per_rank[0]["extra"]
    if "breakdown" in per_rank[0]:
        a.setdefault("breakdown", []).append(per_rank[0]["breakdown"])
    steps = max(len(per_step), 1)
    a["calls"] = {fn: n / steps for fn, n in per_rank[0]["calls"].items()}


def run_timing(args: argparse.Namespace, o: dict, kw: dict, agg: dict[str, dict]) -> None:
    print("timing: all contenders side by side in each rank, one step of each in turn")
    order = list(args.contenders)
    for r in range(args.repeats):
        rotated = order[r % len(order) :] + order[: r % len(order)]
        t0 = time.perf_counter()
        results = run_ranks(args.world_size, time_rank, o, rotated, **kw)
        for name in rotated:
            _add_repeat(agg[name], [res[name] for res in results])
        summary = ", ".join(f"{n} {median(agg[n]['times'][-args.steps :]):.3f}s" for n in rotated)
        print(
            f"  repeat {r + 1}/{args.repeats} (order {','.join(rotated)}): median step {summary} "
            f"[{time.perf_counter() - t0:.1f}s incl. start/build]",
            flush=True,
        )


def run_memory(args: argparse.Namespace, o: dict, kw: dict, agg: dict[str, dict]) -> None:
    print(f"memory: each contender alone in fresh ranks, {args.warmup}+{args.mem_steps} steps")
    for name in args.contenders:
        results = run_ranks(args.world_size, memory_rank, o, name, "memory", **kw)
        for key in ("mem", "mem_steps", "mem_alloc", "mem_reserved", "device_used"):
            if key in results[0]:
                agg[name][key] = max(res[key] for res in results)
        shown = format_bytes(agg[name].get("mem_alloc", agg[name].get("mem")), digits=1)
        print(f"  {name:8s} peak {shown}/rank", flush=True)
    if not args.memtracker:
        return
    for name in args.contenders:
        results = run_ranks(args.world_size, memory_rank, o, name, "memtracker", **kw)
        agg[name]["live_peak"] = max((res["live_peak"] or 0) for res in results)
        agg[name]["live_breakdown"] = results[0]["live_breakdown"]
        peak = format_bytes(agg[name]["live_peak"], digits=1)
        print(f"  {name:8s} MemTracker live-tensor peak {peak}")


def step_ratios(agg: dict[str, dict]) -> str:
    """Each contender's median step and its ratio to FSDP2's (else the bare step's): what
    the timing repeats alone say, printed before the memory runs so a run cut short at its
    time budget still reports it."""
    med = {c: median(a["times"]) for c, a in agg.items() if a["times"]}
    ref = "fsdp2" if "fsdp2" in med else ("bare" if "bare" in med else None)
    cells = [
        f"{c} {t:.4f}s" + (f" ({t / med[ref]:.3f}x {ref})" if ref else "") for c, t in med.items()
    ]
    return "step ratios (medians of the timing repeats): " + "; ".join(cells)


def run_all(args: argparse.Namespace) -> dict[str, dict]:
    """Timing repeats (their step ratios printed at once), then memory runs, then
    (``--profile``) one profiled timing run."""
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
    run_timing(args, o, kw, agg)
    print(step_ratios(agg), flush=True)
    run_memory(args, o, kw, agg)
    if args.profile:
        results = run_ranks(args.world_size, time_rank, o, list(args.contenders), True, **kw)
        for name in args.contenders:
            print(f"\n== cProfile of {name}, rank 0, {args.steps} steps, side by side ==")
            print(results[0][name]["profile"])
    return agg
