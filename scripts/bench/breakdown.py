"""Where the step time goes at world size 2, and what measuring it costs.

Runs ``yatrain.train.loop.pretrain`` on fork-started gloo ranks (``testing.ranks``) for two
shapes: the tiny recipe as shipped, and the engine benchmark's shape (``bench_engine.py``:
dim 512, 6 layers, 8 heads, 4 kv heads, ffn 1536, vocab 8192, seq 256, one sequence per
rank, bf16 weights, fp32 reduction, no activation checkpointing). Every step is logged
(``train.log_every=1``); step 1 (one-off costs) is left out of the figures.

- breakdown: the records' own parts (``train.timing``), as shares of the step time summed
  over the steps; "unattributed" is what no timer covers (target: <= 5%).
- overhead: the added code's own time, measured directly: in each rank process every
  function the breakdown, the stragglers and the hang report add to a step is wrapped by a
  timer (the outermost call only, so nested ones count once; the timer's own two
  ``perf_counter`` calls count against it), summed over the run and divided by the run's
  step time (target: <= 1% of the tiny recipe's step). The busy times ride the loss's
  all-reduce, which was there before (a vector of world size + 1 instead of one number).
  Not timed: one-bytecode attribute
  updates (a collective's ``entered += 1``, the engine's current unit, the data flag); the
  table prints their count per step and the cost of one, timed with ``timeit``.

  python scripts/bench_breakdown.py                    # prepares data in a temp dir
  python scripts/bench_breakdown.py --data data/stdlib --steps 30
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import sys
import tempfile
import time
import timeit
import types
from pathlib import Path

from bench.measure import load_average, table, verdict
from yatrain.data import default_corpus_files, prepare_data
from yatrain.output import console as report
from yatrain.output.record import read_metrics
from yatrain.recipe.load import load_recipe
from yatrain.runtime import hang, stragglers
from yatrain.sharding import comm, timing
from yatrain.testing.ranks import run_ranks
from yatrain.train import timing as step_timing
from yatrain.train.loop import pretrain

REPO = Path(__file__).resolve().parents[2]
SHAPES = {
    "tiny recipe": [],
    "bench shape": [
        "model.dim=512",
        "model.n_layers=6",
        "model.n_heads=8",
        "model.n_kv_heads=4",
        "model.ffn_dim=1536",
        "model.vocab_size=8192",
        "model.max_seq_len=256",
        "data.seq_len=256",
        "data.micro_batch_size=1",
        "data.global_batch_size=2",
        "train.dtype=bf16",
        "sharding.reduce_dtype=fp32",
        "sharding.activation_checkpoint_layers=0",
    ],
}
QUIET = [
    "checkpoint.enabled=false",
    "eval.every=0",
    "eval.at_end=false",
    "logging.wandb.mode=disabled",
    "train.log_every=1",
]
# What the breakdown, the stragglers and the hang report add to a step, timed (module, name).
TIMED = [
    (timing.IntervalClock, "start"),
    (timing.IntervalClock, "stop"),
    (timing.IntervalClock, "take"),
    (step_timing.StepClock, "phase"),
    (step_timing.StepClock, "take"),
    (step_timing.Breakdown, "of"),
    (stragglers, "straggler_fields"),
    (stragglers.StragglerWatch, "note"),
    (hang.StackFile, "arm"),
    (report, "breakdown_text"),
]
COUNTED = [
    (comm.Communicator, "_count"),
    (comm.Communicator, "_count_all_reduce"),
    (comm.Communicator, "_timed_all_reduce"),
]


class Stopwatch:
    """Time spent inside the wrapped functions (outermost calls) and calls counted."""

    def __init__(self) -> None:
        self.seconds, self.depth, self.counted = 0.0, 0, 0

    def timed(self, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if self.depth:
                return fn(*args, **kwargs)
            self.depth += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.depth -= 1

        return wrapper

    def counting(self, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            self.counted += 1
            return fn(*args, **kwargs)

        return wrapper

    def install(self) -> None:
        """Wrap ``TIMED`` and ``COUNTED`` in this process (a fork-started rank)."""
        for owner, name in TIMED:
            raw = owner.__dict__[name]
            if isinstance(raw, classmethod):
                setattr(owner, name, classmethod(self.timed(raw.__func__)))
            else:
                setattr(owner, name, self.timed(raw))
        for owner, name in COUNTED:
            setattr(owner, name, self.counting(getattr(owner, name)))


def _rank(rank: int, world: int, overrides: list[str], run_dir: Path) -> dict:
    watch = Stopwatch()
    watch.install()
    recipe = load_recipe(REPO / "recipes" / "tiny.yaml", overrides)
    with contextlib.redirect_stderr(io.StringIO()):
        pretrain(recipe, recipe_name="bench", run_dir=run_dir, progress=False)
    return {"seconds": watch.seconds, "collectives": watch.counted}


def measure(name: str, overrides: list[str], args, work: Path) -> dict:
    run_dir = work / name.replace(" ", "-")
    extra = [*overrides, *QUIET, f"data.path={args.data}", f"train.steps={args.steps}"]
    extra += args.overrides
    per_rank = run_ranks(2, _rank, extra, run_dir, threads=1)
    records = read_metrics(run_dir / "metrics.jsonl")
    steady = [r for r in records if r.step > 1]
    step_total = sum(r.step_time_s for r in records)  # every record is one step here
    parts = {
        k: sum(getattr(r, k) for r in steady) / sum(r.step_time_s for r in steady)
        for k in report.BREAKDOWN
    }
    return {
        "shape": name,
        "step": sum(r.step_time_s for r in steady) / len(steady),
        **parts,
        "overhead": max(r["seconds"] for r in per_rank) / step_total,
        "collectives": max(r["collectives"] for r in per_rank) / len(records),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=None, help="prepared data dir (default: a temp dir)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma list of " + ", ".join(SHAPES))
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="recipe override for every shape, after its own (repeatable)",
    )
    args = p.parse_args(argv)
    shapes = {name: SHAPES[name] for name in args.shapes.split(",")}
    print(f"# load average {load_average()} at the start", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.data is None:
            args.data = work / "data"
            prepare_data(
                args.data,
                default_corpus_files(max_bytes=2_000_000),
                vocab_size=4096,
                progress=False,
            )
        rows = [measure(name, overrides, args, work) for name, overrides in shapes.items()]
    print_results(rows)
    print(f"# load average {load_average()} at the end", file=sys.stderr)
    return 0


def print_results(rows: list[dict]) -> None:
    """The breakdown per shape, then the targets."""
    counter = types.SimpleNamespace(x=0)
    one_update = min(timeit.repeat("c.x += 1", globals={"c": counter}, number=100_000)) / 1e5
    names = list(report.BREAKDOWN.values())
    print(
        table(
            ["shape", "step s", *names, "added code", "untimed updates/step"],
            [
                [
                    r["shape"],
                    f"{r['step']:.4f}",
                    *(f"{r[k]:.1%}" for k in report.BREAKDOWN),
                    f"{r['overhead']:.3%}",
                    f"{r['collectives']:.0f} x {one_update * 1e9:.0f} ns",
                ]
                for r in rows
            ],
        )
    )
    targets = [
        [
            f"unattributed <= 5% ({r['shape']})",
            f"{r['unattributed_s']:.2%}",
            verdict(r["unattributed_s"], 0.05),
        ]
        for r in rows
    ]
    targets += [
        [
            f"added code <= 1% of the step ({r['shape']})",
            f"{r['overhead']:.3%}",
            verdict(r["overhead"], 0.01),
        ]
        for r in rows
    ]
    print()
    print(table(["target", "measured", "result"], targets))


if __name__ == "__main__":
    sys.exit(main())
