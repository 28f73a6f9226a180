"""Cost of `data.document_mask` on the tiny recipe: the training loop's step time with plain
causal attention, with attention masked at document boundaries, and with positions also
restarting per document, side by side.

Each contender is a real `pretrain` run of `--steps` steps; contenders alternate for
`--repeats` rounds and the table shows the median step time (step 1, which pays one-off
costs, excluded). Without `--data` the stdlib corpus is prepared with a 4096-token
tokenizer in a temporary directory first (what recipes/tiny.yaml trains on).

    python scripts/bench_document_mask.py --data data/stdlib --repeats 3
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from yatrain.data import TokenShards, prepare_data
from yatrain.data.manifest import load_manifest
from yatrain.output.record import read_metrics
from yatrain.recipe.load import load_recipe
from yatrain.train.loop import pretrain

REPO = Path(__file__).resolve().parents[2]

CONTENDERS = {
    "causal (default)": [],
    "document_mask": ["data.document_mask=true"],
    "document_mask + restart_positions": ["data.document_mask=true", "data.restart_positions=true"],
}


def step_times(recipe_path: str, overrides: list[str], run_dir: Path) -> list[float]:
    recipe = load_recipe(recipe_path, overrides)
    with contextlib.redirect_stderr(io.StringIO()):
        pretrain(recipe, recipe_name="bench", run_dir=run_dir, progress=False)
    return [r.step_time_s for r in read_metrics(run_dir / "metrics.jsonl") if r.step > 1]


def documents_per_window(data: Path, seq_len: int) -> float:
    windows = TokenShards.open(data).windows(seq_len)
    return 1 + load_manifest(data)["num_documents"] / max(windows, 1)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default=str(REPO / "recipes" / "tiny.yaml"))
    p.add_argument("--data", type=Path, default=None)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="recipe override for every contender (repeatable)",
    )
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-mask-") as tmp:
        tmp = Path(tmp)
        os.environ["WANDB_MODE"] = "disabled"
        data = args.data
        if data is None:
            data = tmp / "data"
            print("preparing the stdlib corpus (vocab 4096) ...", flush=True)
            with contextlib.redirect_stderr(io.StringIO()):
                prepare_data(data, None, vocab_size=4096, progress=False)
        base = [f"data.path={data}", "logging.wandb.mode=disabled", "train.log_every=1"]
        base += ["checkpoint.enabled=false", "eval.every=0", "eval.at_end=false"]
        base += [f"train.steps={args.steps}", *args.overrides]
        recipe = load_recipe(args.recipe, base)
        d = recipe.data
        print(
            f"bench_document_mask: {Path(args.recipe).name} | {d.global_batch_size} x "
            f"{d.seq_len} tokens/step, micro-batches of {d.micro_batch_size} | dtype "
            f"{recipe.train.dtype} | {torch.get_num_threads()} threads | about "
            f"{documents_per_window(data, d.seq_len):.2f} documents per window | "
            f"{args.repeats} rounds x {args.steps} steps per contender, alternating",
            flush=True,
        )
        times: dict[str, list[float]] = {name: [] for name in CONTENDERS}
        for round_ in range(args.repeats):
            for name, extra in CONTENDERS.items():
                run_dir = tmp / f"run-{round_}-{len(times[name])}-{name.split()[0]}"
                times[name] += step_times(args.recipe, [*base, *extra], run_dir)
    reference = statistics.median(times["causal (default)"])
    print("\n| attention | step time (median) | min..max | vs causal |\n|---|--:|--:|--:|")
    for name, values in times.items():
        median = statistics.median(values)
        print(
            f"| {name} | {median * 1000:.1f} ms | {min(values) * 1000:.1f}.."
            f"{max(values) * 1000:.1f} ms | {median / reference:.3f}x |"
        )


if __name__ == "__main__":
    sys.exit(main())
