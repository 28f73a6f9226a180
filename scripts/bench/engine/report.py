"""The engine benchmark's report: the run's setup, one table of medians and ratios, targets.

Two comparisons with FSDP2 are reported apart: the engine alone (``yatrain``, the same plain
loss as FSDP2) and the product (``yatrain-chunked``, the loss ``yatrain pretrain`` uses)."""

from __future__ import annotations

import argparse

import torch

from bench.engine.blocks import block_seconds
from bench.engine.contenders import model_config
from bench.engine.planned import planned_vs_measured
from bench.measure import median, spread, table, verdict
from yatrain.common import format_bytes
from yatrain.models.llama import count_parameters, flops_per_token
from yatrain.runtime.device import measure_matmul_flops, peak_flops


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
    if planned := planned_vs_measured(args, agg):
        print(planned)
        print()
    _targets(args, agg, med, mem)


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
        if "breakdown" in a:  # rank 0's mean per measured step, medians over the repeats
            parts = [median(p[i] for p in a["breakdown"]) for i in range(3)]
            note += (
                f"; of a step: compute {parts[0]:.3f}s, exposed communication "
                f"{parts[1]:.3f}s, optimizer {parts[2]:.3f}s"
            )
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
    headers += (
        ["peak alloc/rank", "peak reserved/rank"] if cuda else ["peak mem/rank", "(steps only)"]
    )
    headers += ["live-tensor peak"] if args.memtracker else []
    headers += ["bytes sent/step/rank", "final loss"]
    headers += [f"step vs {ref}", f"mem vs {ref}"] if ref else []
    headers += [f"live vs {ref}"] if ref and args.memtracker else []
    rows = []
    for c, a in agg.items():
        t = med[c]
        row = [
            c,
            f"{t:.3f}",
            spread(a["times"]),
            f"{tokens / t:,.0f}",
            f"{tokens / args.world_size / t * fpt / peak:.1%}",
            _size(mem[c]),
            _size(a.get("mem_reserved" if cuda else "mem_steps")),
        ]
        if args.memtracker:
            row.append(_size(a.get("live_peak")))
        row.append(_size(median(a["bytes"])) if args.world_size > 1 else "0 (1 rank)")
        row.append(f"{median(a['loss']):.5f}")
        if ref:
            row.append(f"{t / med[ref]:.3f}x")
            row.append(f"{mem[c] / mem[ref]:.3f}x" if mem[c] and mem[ref] else "n/a")
        if ref and args.memtracker:
            live, live_ref = a.get("live_peak"), agg[ref].get("live_peak")
            row.append(f"{live / live_ref:.3f}x" if live and live_ref else "n/a")
        rows.append(row)
    return table(headers, rows)


# The targets: bf16 weights with fp32 reduction, and fp32 (step, peak RSS, live).
TARGETS = {"bf16": (0.80, 0.95, 1.0), "fp32": (0.75, None, 1.2)}
COMPARISONS = (("engine only", "yatrain"), ("product", "yatrain-chunked"))


def _targets(args, agg: dict, med: dict, mem: dict) -> None:
    checks = []
    step_t, mem_t, live_t = TARGETS[args.dtype]
    for label, c in COMPARISONS if "fsdp2" in med and args.world_size > 1 else ():
        if c not in med:
            continue
        r = med[c] / med["fsdp2"]
        checks.append(
            (f"{label}: {c} step time <= {step_t:.2f}x FSDP2", f"{r:.3f}x", verdict(r, step_t))
        )
        if mem_t and mem[c] and mem["fsdp2"]:
            m = mem[c] / mem["fsdp2"]
            checks.append(
                (f"{label}: {c} peak memory <= {mem_t:.2f}x FSDP2", f"{m:.3f}x", verdict(m, mem_t))
            )
        live, live_ref = agg[c].get("live_peak"), agg["fsdp2"].get("live_peak")
        if live and live_ref:
            ratio = live / live_ref
            checks.append(
                (
                    f"{label}: {c} live tensors <= {live_t:.2f}x FSDP2",
                    f"{ratio:.3f}x",
                    verdict(ratio, live_t),
                )
            )
    checks += _compile_targets(med, mem)
    if "yatrain-compile" in med and "yatrain" in med and args.device == "cpu":
        share = block_seconds(vars(args)) / med["yatrain"]
        print(
            f"decoder blocks (forward + backward, eager, alone): {share:.0%} of the eager "
            "yatrain step: compiling them can save at most that share"
        )
    if "yatrain" in med and "bare" in med:
        r = med["yatrain"] / med["bare"]
        checks.append(("world 1: yatrain step time <= 1.03x bare", f"{r:.3f}x", verdict(r, 1.03)))
    checks += _buffered_targets(med, mem)
    if checks:
        print(table(["target", "measured", "result"], checks))


def _buffered_targets(med: dict, mem: dict) -> list[tuple[str, str, str]]:
    """The buffered path (every multi-GPU run's) against FSDP2, and what the step clock
    that ``yatrain pretrain`` always runs costs it."""
    checks = []
    if "yatrain-pg" in med and "fsdp2" in med:
        r = med["yatrain-pg"] / med["fsdp2"]
        checks.append(("yatrain-pg step time <= 1.00x FSDP2", f"{r:.3f}x", verdict(r, 1.0)))
        if mem.get("yatrain-pg") and mem.get("fsdp2"):
            m = mem["yatrain-pg"] / mem["fsdp2"]
            checks.append(("yatrain-pg peak memory <= FSDP2", f"{m:.3f}x", verdict(m, 1.0)))
    if "yatrain-pg" in med and "yatrain-pg-noclock" in med:
        r = med["yatrain-pg"] / med["yatrain-pg-noclock"]
        checks.append(("step clock: yatrain-pg / without it (cost)", f"{r:.3f}x", "measured"))
    return checks


# train.compile's targets (fp32 on CPU): compiled vs eager, and vs FSDP2 compiled.
COMPILE_TARGETS = (("yatrain-compile", "yatrain", 0.80), ("yatrain-compile", "fsdp2-compile", 0.85))


def _compile_targets(med: dict, mem: dict) -> list[tuple[str, str, str]]:
    checks = []
    for contender, baseline, limit in COMPILE_TARGETS:
        if contender in med and baseline in med:
            r = med[contender] / med[baseline]
            checks.append(
                (
                    f"compile: {contender} step time <= {limit:.2f}x {baseline}",
                    f"{r:.3f}x",
                    verdict(r, limit),
                )
            )
    c, ref = mem.get("yatrain-compile"), mem.get("fsdp2-compile")
    if c and ref:
        checks.append(
            (
                "compile: yatrain-compile peak memory <= fsdp2-compile",
                f"{c / ref:.3f}x",
                verdict(c / ref, 1.0),
            )
        )
    return checks


def _peak_flops(args) -> tuple[float, str]:
    if args.device == "cuda" and torch.cuda.is_available():
        return peak_flops(torch.device("cuda", 0), args.dtype)
    torch.set_num_threads(args.threads)  # the per-rank thread budget
    flops = measure_matmul_flops(torch.device("cpu"), args.dtype)
    return flops, f"measured cpu matmul, {args.threads} thread(s)"
