"""AdamW against Muon on the embedded corpus: the tiny recipe, the same steps, three rates each.

    python scripts/compare_optimizers.py                   # data/stdlib, made by scripts/demo.sh
    python scripts/compare_optimizers.py --steps 120 --adamw-lrs 1e-3 3e-3 1e-2

Each run is ``yatrain pretrain recipes/tiny.yaml`` in a child process (``bench.pretrain_cli``),
one after another, all from the same seed and data order for the same steps, with
``optim.lr`` set to each rate (``optim.min_lr`` a tenth of it, as the recipe has it) and
``optim.name`` to ``adamw`` or ``muon``. Muon's rate is ``optim.lr`` too
(``muon_adjust_lr: match_rms_adamw``, the default, is made for that) and its Newton-Schulz
runs in fp32 (``optim.muon_ns_dtype``: a CPU without bf16 matmuls takes some 30x longer in
bf16). The held-out loss is the recipe's own evaluation (``eval.every`` 30 and at the end,
``eval.batches`` 4: 8,192 held-out tokens), read from each run's ``metrics.jsonl``. No
checkpoints, W&B off, one torch thread a run unless ``--threads`` (two threads on two shared
cores slow a step tenfold when a neighbour takes one). Printed: each run's held-out loss at
every evaluation, its best, its median step time; then each optimizer's best held-out loss
over the rates.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from bench.measure import load_average, median, table
from bench.pretrain_cli import run_pretrain

OPTIMIZERS = ("adamw", "muon")
# Peak rates, a factor ~3 apart: AdamW's around and below the tiny recipe's 3e-3, Muon's
# around and above it (a first run at 1e-3, 3e-3, 1e-2 for both found AdamW best at the
# lowest and Muon at the highest)
LRS = {"adamw": (3e-4, 1e-3, 3e-3), "muon": (3e-3, 1e-2, 3e-2)}


def pretrain(args: argparse.Namespace, run_dir: Path, name: str, lr: float) -> list[dict]:
    """One run of the recipe with optimizer ``name`` at peak rate ``lr``: its records."""
    sets = [
        *args.set,
        f"data.path={args.data}",
        f"optim.name={name}",
        f"optim.lr={lr}",
        f"optim.min_lr={lr / 10}",
        "checkpoint.enabled=false",
        "logging.wandb.mode=disabled",
    ]
    if name == "muon":
        sets.append("optim.muon_ns_dtype=fp32")
    env = {"OMP_NUM_THREADS": str(args.threads)}
    records, _ = run_pretrain("compare_optimizers", args.recipe, run_dir, args.steps, sets, env)
    return records


def summary(records: list[dict]) -> dict:
    """The held-out loss at each evaluation (step -> loss), the best, the median step."""
    held_out = {r["step"]: r["val_loss"] for r in records if r.get("val_loss") is not None}
    if not held_out:
        raise SystemExit("compare_optimizers: a run evaluated nothing: set eval.every or at_end")
    return {
        "held_out": held_out,
        "best": min(held_out.values()),
        "step_s": median(r["step_time_s"] for r in records[1:] or records),
    }


def tables(runs: dict[tuple[str, float], dict]) -> str:
    """Every run's evaluations, and each optimizer's best rate."""
    steps = sorted({step for got in runs.values() for step in got["held_out"]})
    headers = ["optimizer", "optim.lr", *[f"held-out @ {s}" for s in steps], "best", "s/step"]
    rows = []
    for (name, lr), got in runs.items():
        losses = [f"{got['held_out'][s]:.4f}" if s in got["held_out"] else "-" for s in steps]
        rows.append([name, f"{lr:g}", *losses, f"{got['best']:.4f}", f"{got['step_s']:.3f}"])
    best_rows = []
    for name in dict.fromkeys(name for name, _ in runs):
        lr, got = min(
            ((lr, g) for (n, lr), g in runs.items() if n == name), key=lambda item: item[1]["best"]
        )
        best_rows.append([name, f"{got['best']:.4f}", f"{lr:g}"])
    best = table(["optimizer", "best held-out loss", "at optim.lr"], best_rows)
    return f"{table(headers, rows)}\n\n{best}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipe", default="recipes/tiny.yaml")
    p.add_argument("--data", type=Path, default=Path("data/stdlib"), help="a prepared directory")
    p.add_argument("--steps", type=int, default=120, help="optimizer steps of every run")
    for name in OPTIMIZERS:
        spec = dict(type=float, nargs="*", default=list(LRS[name]), help="peak rates (optim.lr)")
        p.add_argument(f"--{name}-lrs", **spec)
    p.add_argument("--set", action="append", default=[], help="more overrides (dotted=value)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of each run")
    args = p.parse_args(argv)
    manifest = args.data / "manifest.json"
    if not manifest.is_file() or "validation" not in json.loads(manifest.read_text()):
        print(
            f"compare_optimizers: {args.data} is no prepared directory with a held-out split; "
            "make it with `bash scripts/demo.sh --steps 1` (prepare-data "
            "--val-fraction 0.02)",
            file=sys.stderr,
        )
        return 1
    extra = " ".join(args.set)
    grid = {name: getattr(args, f"{name}_lrs") for name in OPTIMIZERS}
    rates = "; ".join(f"{name} {' '.join(f'{lr:g}' for lr in lrs)}" for name, lrs in grid.items())
    print(
        f"compare_optimizers: {args.recipe} {extra} | {args.steps} steps | rates: "
        f"{rates} | load {load_average()}",
        flush=True,
    )
    runs: dict[tuple[str, float], dict] = {}
    with tempfile.TemporaryDirectory(prefix="compare-optimizers-") as scratch:
        for turn in range(max(len(lrs) for lrs in grid.values())):  # load hits both alike
            for name, lr in [(name, lrs[turn]) for name, lrs in grid.items() if turn < len(lrs)]:
                records = pretrain(args, Path(scratch) / f"{name}-{lr:g}", name, lr)
                runs[(name, lr)] = got = summary(records)
                print(
                    f"  {name} lr {lr:g}: best held-out {got['best']:.4f}, "
                    f"{got['step_s']:.3f} s/step",
                    flush=True,
                )
    print(tables(runs))
    print(f"load average at the end: {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
