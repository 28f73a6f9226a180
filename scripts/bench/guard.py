"""What the per-step checks cost the host: device reads and waits per step, and step time.

    PYTHONPATH=scripts python -m bench.guard --baseline 9c023c6          # world 2, gloo
    PYTHONPATH=scripts python -m bench.guard --baseline 9c023c6 --device cuda   # on a GPU

Each yatrain (this tree, and with ``--baseline REV`` the one of git revision REV beside it)
runs ``pretrain`` of the recipe on 2 fork-started gloo ranks (CPU) or one process on a GPU,
with ``train.log_every`` 4, no checkpoint and no evaluation. ``testing.host_syncs`` counts
what makes the host wait for the device (value reads, device-to-host copies, stream and
device synchronisations) in every loop iteration; the iteration's wall time is measured
from one step's start to the next. Printed per yatrain: host waits per step between log
steps and at log steps, and the median step time between log steps, side by side. The
baseline is measured with this tree's counter (``host_syncs.py`` and ``host_reads.py``
laid over its package: they only count), so both sides count the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.measure import load_average, yatrain_at

REPO = Path(__file__).resolve().parents[2]
COUNTER_FILES = ("yatrain/testing/host_syncs.py", "yatrain/runtime/host_reads.py")

_RUN = """
import json, statistics, sys, time
from pathlib import Path
import pytest, torch
from yatrain.recipe.load import load_recipe
from yatrain.testing.host_syncs import HostSyncCounter
from yatrain.testing.ranks import run_ranks
from yatrain.train import loop

recipe_path, steps, log_every, device, run_dir = sys.argv[1:6]
steps, log_every = int(steps), int(log_every)
overrides = [*sys.argv[6:], f"train.log_every={log_every}", "checkpoint.enabled=false",
             "eval.every=0", "eval.at_end=false", "logging.wandb.mode=disabled"]  # ours last

def measured(rank, world):
    counter, started, clock = HostSyncCounter(), {}, {}
    real = loop.step
    def step(run, step_number, guard):
        started[step_number], clock[step_number] = counter.total(), time.perf_counter()
        return real(run, step_number, guard)
    recipe = load_recipe(recipe_path, overrides)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loop, "step", step)
        with counter:
            loop.pretrain(recipe, run_dir=Path(run_dir) / f"rank{rank}", steps=steps,
                          progress=False)
        ended, end = counter.total(), time.perf_counter()
    order = sorted(started)
    counts = [started[s] for s in order] + [ended]
    times = [clock[s] for s in order] + [end]
    logged = {s for s in order if s == order[0] or s % log_every == 0 or s == order[-1]}
    quiet = [s for s in order[1:] if s not in logged]  # the first step warms up
    waits = {s: counts[i + 1] - counts[i] for i, s in enumerate(order)}
    seconds = {s: times[i + 1] - times[i] for i, s in enumerate(order)}
    return {
        "quiet_waits": statistics.mean(waits[s] for s in quiet),
        "log_waits": statistics.mean(waits[s] for s in logged),
        "step_s": statistics.median(seconds[s] for s in quiet),
    }

if device == "cuda":
    print(json.dumps(measured(0, 1)))
else:
    print(json.dumps(run_ranks(2, measured)[0]))
"""


def measure(root: Path, args: argparse.Namespace, run_dir: Path) -> dict:
    command = [sys.executable, "-c", _RUN, str(REPO / args.recipe), str(args.steps),
               str(args.log_every), args.device, str(run_dir), *args.overrides]  # fmt: skip
    done = subprocess.run(
        command,
        cwd=root,  # `python -c` puts the working directory first on sys.path
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
    )
    if done.returncode:
        sys.exit(f"{root}: the run failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def baseline_tree(revision: str, into: Path) -> Path:
    """REV's package, with this tree's counter laid over it (it counts, it changes nothing)."""
    yatrain_at(revision, into)
    for name in COUNTER_FILES:
        shutil.copyfile(REPO / name, into / name)
    return into


def corpus(scratch: Path) -> Path:
    """The demo's tokenized corpus when it is there, else a slice of it made now."""
    if (REPO / "data/stdlib/manifest.json").is_file():
        return REPO / "data/stdlib"
    from yatrain.data import default_corpus_files, prepare_data

    out = scratch / "stdlib"
    prepare_data(out, default_corpus_files(max_bytes=2_000_000), vocab_size=4096, progress=False)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="recipes/tiny.yaml")
    parser.add_argument("--set", action="append", default=[], dest="overrides")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--log-every", type=int, default=4)
    parser.add_argument("--baseline", help="a git revision to measure beside this tree")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    where = "2 gloo ranks" if args.device == "cpu" else "1 GPU"
    with tempfile.TemporaryDirectory(prefix="yatrain-bench-guard-") as scratch:
        print(f"{args.recipe} {' '.join(args.overrides)}, {args.steps} steps, log every "
              f"{args.log_every}, {where}, load {load_average()}")  # fmt: skip
        if not any(o.startswith("data.path=") for o in args.overrides):
            args.overrides = [f"data.path={corpus(Path(scratch))}", *args.overrides]
        print("| yatrain | host waits per step between logs | at a log step | step time |")
        print("|---|--:|--:|--:|")
        trees = [("this tree", REPO)]
        if args.baseline:
            trees.insert(0, (args.baseline, baseline_tree(args.baseline, Path(scratch) / "old")))
        runs: dict[str, list[dict]] = {name: [] for name, _ in trees}
        for repeat in range(args.repeats):  # interleaved: the machine's load hits both alike
            for name, root in trees:
                run_dir = Path(scratch) / f"{name.replace(' ', '-')}-{repeat}"
                runs[name].append(measure(root, args, run_dir))
        steps = {name: statistics.median(r["step_s"] for r in got) for name, got in runs.items()}
        for name, got in runs.items():
            print(f"| {name} | {got[0]['quiet_waits']:.1f} | {got[0]['log_waits']:.1f} | "
                  f"{steps[name] * 1e3:.1f} ms |")  # fmt: skip
        if args.baseline:
            ratio = steps["this tree"] / steps[args.baseline]
            print(f"step time (median of {args.repeats} interleaved runs), this tree / "
                  f"{args.baseline}: {ratio:.3f}x")  # fmt: skip


if __name__ == "__main__":
    main()
