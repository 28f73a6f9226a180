"""The engine benchmark's report: the run's setup, one table of medians and ratios, targets."""

from __future__ import annotations

import argparse

import torch

from yatrain.bench.engine.contenders import model_config
from yatrain.bench.measure import median, spread, table, verdict
from yatrain.common import format_bytes
from yatrain.models.llama import count_parameters, flops_per_token
from yatrain.train.metrics import measure_matmul_flops, peak_flops


def _size(n: float | None) -> str:
    return format_bytes(n, digits=1)


def report(args: argparse.Namespace, agg: dict[str, dict]) -> None:
    peak, peak_src = _peak_flops(args)
    _print_setup(args, agg, peak, peak_src)
    med = {c: median(a["times"]) for c, a in agg.items()}
    mem = {c: a.get("mem_alloc" if args.device == "cuda" else "mem") for c, a in agg.items()}
    print()
    print(_table(args, agg, med, mem, peak))
    print()
    _targets(args, med, mem)


def _print_setup(args: argparse.Namespace, agg: dict[str, dict], peak: float, src: str) -> None:
    cfg = model_config(vars(args))
    tokens = args.world_size * args.accum * args.micro_batch * args.seq_len
    n_params = count_parameters(cfg)
    print()
    print(
        f"model: dim {cfg.dim}, {cfg.n_layers} layers, {cfg.n_heads} heads / {cfg.n_kv_heads} kv, "
        f"ffn {cfg.ffn_dim}, vocab {cfg.vocab_size}: {n_params / 1e6:.2f}M params "
        f"({format_bytes(n_params * 4, 'MiB', digits=0)} fp32); seq {args.seq_len}, micro-batch "
        f"{args.micro_batch} x accum {args.accum} per rank, {tokens} tokens/step; dtype "
        f"{args.dtype}, reduce {args.reduce_dtype}, AC layers {args.ac_layers}"
    )
    print(
        f"run: {args.device}, world {args.world_size} "
        f"({'nccl' if args.device == 'cuda' else 'gloo'}), {args.threads} thread(s)/rank, "
        f"{args.repeats} repeats x ({args.warmup} warm-up + {args.steps} measured) steps of each "
        f"contender, round-robin; torch {torch.__version__}; MFU vs {peak / 1e12:.3g} TFLOP/s "
        f"({src})"
    )
    for c, a in agg.items():
        calls = ", ".join(f"{k} x{v:g}" for k, v in sorted(a["calls"].items())) or "none"
        note = f"  {c}: {a['extra'].get('optimizer', '')}; collectives per step: {calls}"
        if a["engine_bytes"]:
            note += f"; engine.bytes_sent/step {_size(median(a['engine_bytes']))}"
        note += f"; build {median(a['build']):.2f}s"
        print(note)
        if a.get("live_breakdown"):
            parts = ", ".join(
                f"{getattr(k, 'name', k)} {_size(v)}" for k, v in a["live_breakdown"].items() if v
            )
            print(f"    MemTracker peak: {parts}")


def _table(args, agg: dict[str, dict], med: dict, mem: dict, peak: float) -> str:
    cuda = args.device == "cuda"
    tokens = args.world_size * args.accum * args.micro_batch * args.seq_len
    fpt = flops_per_token(model_config(vars(args)), args.seq_len)
    ref = "fsdp2" if "fsdp2" in agg else ("bare" if "bare" in agg else None)
    headers = ["contender", "median step s", "step range s", "tokens/s (global)", "MFU"]
    headers += ["peak alloc/rank", "peak reserved/rank"] if cuda else ["peak mem/rank",
                                                                       "(steps only)"]  # fmt: skip
    headers += ["live-tensor peak"] if args.memtracker else []
    headers += ["bytes sent/step/rank", "final loss"]
    headers += [f"step vs {ref}", f"mem vs {ref}"] if ref else []
    rows = []
    for c, a in agg.items():
        t = med[c]
        row = [c, f"{t:.3f}", spread(a["times"]), f"{tokens / t:,.0f}",
               f"{tokens / args.world_size / t * fpt / peak:.1%}", _size(mem[c]),
               _size(a.get("mem_reserved" if cuda else "mem_steps"))]  # fmt: skip
        if args.memtracker:
            row.append(_size(a.get("live_peak")))
        row.append(_size(median(a["bytes"])) if args.world_size > 1 else "0 (1 rank)")
        row.append(f"{median(a['loss']):.5f}")
        if ref:
            row.append(f"{t / med[ref]:.3f}x")
            row.append(f"{mem[c] / mem[ref]:.3f}x" if mem[c] and mem[ref] else "n/a")
        rows.append(row)
    return table(headers, rows)


def _targets(args, med: dict, mem: dict) -> None:
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
    if args.device == "cuda" and torch.cuda.is_available():
        return peak_flops(torch.device("cuda", 0), args.dtype)
    torch.set_num_threads(args.threads)  # the per-rank thread budget
    flops = measure_matmul_flops(torch.device("cpu"), args.dtype)
    return flops, f"measured cpu matmul, {args.threads} thread(s)"
