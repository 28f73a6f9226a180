"""train.compile through the CLI: steady-state step time, eager vs compiled, and its cost.

Each repeat runs ``yatrain pretrain`` twice on the same recipe and data, once eager and once
with ``--set train.compile=true``, in alternating order, each in a fresh run directory with
its own fresh ``train.compile_cache`` (so each compiled run starts with a cold inductor
cache, as a new run does). The steady-state
step time is the median of the logged windows' step times after step 1 (compile time is
left out of them by the loop and read from its "compiled N graphs in X s" line). Finally the
last compiled run is restarted for a few more steps in its run directory with the same
cache, where it finds its kernels: the warm start.

  python -m bench.compile --data data/stdlib                       # tiny recipe shape
  python -m bench.compile --data data/stdlib --set model.dim=512 --set model.n_layers=8
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

from bench.measure import load_average, median, table
from bench.pretrain_cli import run_pretrain

COMPILED_LINE = re.compile(r"compiled (\d+) graphs? in ([0-9.]+)s")


def pretrain(args, run_dir: Path, compiled: bool, steps: int) -> tuple[float, float | None]:
    """One CLI run: (median steady-state step time, compile seconds or None)."""
    sets = [
        *args.set,
        f"data.path={args.data}",
        f"train.compile={str(compiled).lower()}",
        f"train.compile_cache={run_dir.with_name(run_dir.name + '-cache')}",
        f"train.dtype={args.dtype}",
        f"train.log_every={args.log_every}",
        "eval.every=0",
        "eval.at_end=false",
        "checkpoint.every=0",
        "logging.wandb.mode=disabled",
    ]
    env = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else None
    records, stderr = run_pretrain("compile", args.recipe, run_dir, steps, sets, env)
    steady = [r["step_time_s"] for r in records if r["step"] > records[0]["step"]]
    found = COMPILED_LINE.search(stderr)
    return median(steady), float(found.group(2)) if found else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="recipes/tiny.yaml")
    p.add_argument("--data", required=True, help="a prepared data directory")
    p.add_argument("--set", action="append", default=[], help="recipe overrides (dotted=value)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--steps", type=int, default=26)
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--repeats", type=int, default=2)
    threads = "torch threads per run (default: torch's; 1 on a machine others share)"
    p.add_argument("--threads", type=int, default=None, help=threads)
    args = p.parse_args(argv)
    what = f"{args.recipe} {' '.join(args.set)} | {args.dtype} | {args.steps} steps"
    what += f" | threads {args.threads or 'default'}"
    print(f"bench compile: {what} x {args.repeats} repeats | load {load_average()}", flush=True)
    times: dict[bool, list[float]] = {False: [], True: []}
    cold: list[float] = []
    with tempfile.TemporaryDirectory(prefix="bench-compile-") as tmp:
        for repeat in range(args.repeats):
            for compiled in (False, True) if repeat % 2 == 0 else (True, False):
                run_dir = Path(tmp) / f"r{repeat}-{'compiled' if compiled else 'eager'}"
                step, seconds = pretrain(args, run_dir, compiled, args.steps)
                times[compiled].append(step)
                cold += [seconds] if seconds is not None else []
                print(
                    f"  repeat {repeat + 1}: {'compiled' if compiled else 'eager   '} "
                    f"{step:.3f}s/step" + (f", compile {seconds:.1f}s" if compiled else ""),
                    flush=True,
                )
        last = Path(tmp) / f"r{args.repeats - 1}-compiled"
        _, warm = pretrain(args, last, True, args.steps + args.log_every)  # restart: warm cache
    eager, compiled = median(times[False]), median(times[True])
    rows = [
        [
            args.dtype,
            f"{eager:.3f}",
            f"{compiled:.3f}",
            f"{compiled / eager:.3f}x",
            f"{median(cold):.1f}",
            f"{warm:.1f}" if warm is not None else "-",
        ]
    ]
    headers = [
        "dtype",
        "eager s/step",
        "compiled s/step",
        "compiled/eager",
        "compile s (cold)",
        "compile s (warm restart)",
    ]
    print(table(headers, rows))
    print(f"load average at the end: {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
