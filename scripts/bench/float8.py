"""train.float8's numerics through the CLI: does a float8 run learn what the plain run does?

Runs ``yatrain pretrain`` on one recipe and data once per variant (plain, ``tensorwise``,
``rowwise``), same seed and steps, logging every step, and compares each float8 run with the
plain one: the mean training loss of the last 20 steps and the held-out loss at the end
(distance in % of the plain run's; the target is within 1.5%), the median step time, and
the loss curve at a few steps. On a CPU the fp8 matmuls are emulated (torch._scaled_mm
computes in higher precision): the step times say what float8 costs here, not on a GPU.

  python -m bench.float8 --data data/stdlib --dtype bf16 --steps 300
  python -m bench.float8 --data data/stdlib --dtype fp32 --steps 300 --curve out.csv
"""

from __future__ import annotations

import argparse
import csv
import sys
import tempfile
from pathlib import Path

from bench.measure import load_average, median, table, verdict
from bench.pretrain_cli import run_pretrain

VARIANTS = ("null", "tensorwise", "rowwise")
LAST = 20  # steps whose mean training loss is compared
TARGET = 1.5  # % of the plain run's loss


def pretrain(args, run_dir: Path, float8: str) -> list[dict]:
    """One CLI run; its metrics records (one per step)."""
    sets = [
        *args.set,
        f"data.path={args.data}",
        f"train.dtype={args.dtype}",
        f"train.float8={float8}",
        "train.log_every=1",
        f"eval.every={args.eval_every}",
        "eval.at_end=true",
        "checkpoint.enabled=false",
        "logging.wandb.mode=disabled",
    ]
    records, _ = run_pretrain("float8", args.recipe, run_dir, args.steps, sets)
    return records


def summary(records: list[dict]) -> dict:
    """Last-20 mean training loss, final held-out loss, median step time after step 1."""
    losses = [r["loss"] for r in records]
    held_out = [r["val_loss"] for r in records if r.get("val_loss") is not None]
    return {
        "last": sum(losses[-LAST:]) / len(losses[-LAST:]),
        "held_out": held_out[-1],
        "step_s": median(r["step_time_s"] for r in records[1:]),
    }


def distance(value: float, plain: float) -> float:
    return 100 * abs(value - plain) / plain


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="recipes/tiny.yaml")
    p.add_argument("--data", required=True, help="a prepared data directory")
    p.add_argument("--set", action="append", default=[], help="recipe overrides (dotted=value)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--curve", type=Path, help="write every step's loss per variant (CSV)")
    args = p.parse_args(argv)
    what = f"{args.recipe} {' '.join(args.set)} | {args.dtype} | {args.steps} steps"
    print(f"bench float8: {what} | load {load_average()}", flush=True)
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-float8-") as tmp:
        for variant in args.variants:
            runs[variant] = pretrain(args, Path(tmp) / variant, variant)
            got = summary(runs[variant])
            print(
                f"  {variant}: last-{LAST} loss {got['last']:.4f}, held-out "
                f"{got['held_out']:.4f}, {got['step_s']:.3f} s/step",
                flush=True,
            )
    print(table(*_rows(runs)))
    print(table(*_curve_rows(runs, args.steps)))
    if args.curve:
        _write_curve(args.curve, runs)
    print(f"load average at the end: {load_average()}")
    return 0


def _rows(runs: dict[str, list[dict]]) -> tuple[list[str], list[list[str]]]:
    base = summary(runs["null"]) if "null" in runs else None
    headers = [
        "train.float8",
        f"last-{LAST} train loss",
        "distance",
        "held-out loss",
        "distance",
        f"within {TARGET}%",
        "s/step",
        "vs plain",
    ]
    rows = []
    for variant, records in runs.items():
        got = summary(records)
        if base is None or variant == "null":
            rows.append(
                [
                    variant,
                    f"{got['last']:.4f}",
                    "-",
                    f"{got['held_out']:.4f}",
                    "-",
                    "-",
                    f"{got['step_s']:.3f}",
                    "-",
                ]
            )
            continue
        near = max(distance(got["last"], base["last"]), distance(got["held_out"], base["held_out"]))
        rows.append(
            [
                variant,
                f"{got['last']:.4f}",
                f"{distance(got['last'], base['last']):.2f}%",
                f"{got['held_out']:.4f}",
                f"{distance(got['held_out'], base['held_out']):.2f}%",
                verdict(near, TARGET),
                f"{got['step_s']:.3f}",
                f"{got['step_s'] / base['step_s']:.2f}x",
            ]
        )
    return headers, rows


def _curve_rows(runs: dict[str, list[dict]], steps: int) -> tuple[list[str], list[list[str]]]:
    """Training loss (and held-out loss where measured) at about ten steps of the run."""
    marks = sorted({1, *range(max(1, steps // 10), steps + 1, max(1, steps // 10)), steps})
    by_step = {v: {r["step"]: r for r in records} for v, records in runs.items()}
    rows = []
    for step in marks:
        cells = [str(step)]
        for variant in runs:
            record = by_step[variant].get(step, {})
            loss, val = record.get("loss"), record.get("val_loss")
            cells.append("-" if loss is None else f"{loss:.4f}" + (f" ({val:.4f})" if val else ""))
        rows.append(cells)
    return ["step", *[f"{v} train (held-out)" for v in runs]], rows


def _write_curve(path: Path, runs: dict[str, list[dict]]) -> None:
    with path.open("w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(["variant", "step", "loss", "val_loss"])
        for variant, records in runs.items():
            for r in records:
                writer.writerow([variant, r["step"], r["loss"], r.get("val_loss", "")])


if __name__ == "__main__":
    sys.exit(main())
