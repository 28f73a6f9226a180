"""The yatrain training loop vs a bare PyTorch loop on the same model and batches.

Contenders, run in this one process, alternating block by block (the order flips every
repeat) so that machine noise hits both alike:

- yatrain: the real entry point, ``yatrain.train.loop.pretrain(recipe, steps=N)``, on a
  recipe (default ``recipes/tiny.yaml``) with W&B disabled and ``train.log_every = 1``; its
  per-step ``step_time_s`` and ``data_wait_frac`` are read back from the run's
  ``metrics.jsonl``. The loop's clock covers set-LR, data, forward/backward, reduction,
  clipping, optimizer step and the sync before a log; writing the log record itself is
  outside it (the loop's own definition, kept as is).
- bare: the same model config (activation checkpointing included), the same loader and
  therefore the same micro-batches, the same LR schedule, AdamW with the same decay groups
  (fused if available, else foreach), ``clip_grad_norm_``, ``zero_grad(set_to_none=True)``;
  bf16 means autocast with fp32 weights, the plain-PyTorch way. Each step is timed over
  the same span as the loop's.

Step 1 of every block is dropped (one-off costs); figures are medians over all other
steps of all blocks. Both read batches through ``GlobalBatchLoader``, so the ratio
compares the training step machinery; the data wait fraction (time inside
``loader.next_batch()`` over step time) is reported for both.

  python scripts/bench_loop.py --data data/stdlib           # reuse prepared data
  python scripts/bench_loop.py                              # prepares data in a temp dir
  python scripts/bench_loop.py --set model.n_layers=8 --dtype bf16 --steps 30
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.bare import bare_adamw, bare_step, decay_groups
from bench.measure import load_average, median, spread, table, verdict
from yatrain.common import DTYPES
from yatrain.data import build_loader, prepare_data
from yatrain.models.llama import count_parameters, materialize
from yatrain.output.record import read_metrics
from yatrain.recipe.config import Recipe
from yatrain.recipe.load import load_recipe
from yatrain.train.build import meta_model
from yatrain.train.loop import pretrain
from yatrain.train.optim import set_lr
from yatrain.train.schedule import lr_at

REPO = Path(__file__).resolve().parents[2]
YATRAIN, BARE = "yatrain (pretrain)", "bare PyTorch"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default=str(REPO / "recipes" / "tiny.yaml"))
    p.add_argument(
        "--data",
        default=None,
        help="prepared data dir to reuse (default: prepare "
        "the stdlib corpus with a 4096-token tokenizer in a temp dir, ~12 s)",
    )
    p.add_argument("--steps", type=int, default=10, help="steps per block (>= 2)")
    p.add_argument("--repeats", type=int, default=3, help="blocks per contender")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="recipe override, e.g. --set model.n_layers=8 (repeatable)",
    )
    p.add_argument(
        "--dtype", choices=tuple(DTYPES), default=None, help="override train.dtype of the recipe"
    )
    p.add_argument("--verbose", action="store_true", help="show pretrain's own log lines")
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error("--steps must be at least 2 (step 1 is excluded from the timing)")
    return args


def load(args: argparse.Namespace, data_dir: Path) -> Recipe:
    overrides = [
        *args.overrides,
        f"data.path={data_dir}",
        "logging.wandb.mode=disabled",
        "train.log_every=1",  # a metrics record (step time, data wait) for every step
        # Save only after the last step: a periodic save lands in the next step's window.
        "checkpoint.every=0",
        "eval.every=0",  # step times only: no held-out evaluation
        "eval.at_end=false",
        f"train.steps={args.steps}",
    ]
    if args.dtype:
        overrides.append(f"train.dtype={args.dtype}")
    return load_recipe(args.recipe, overrides)


# ---------------------------------------------------------------------------- contenders


def run_yatrain(recipe: Recipe, run_dir: Path, verbose: bool) -> dict:
    sink = contextlib.nullcontext() if verbose else contextlib.redirect_stderr(io.StringIO())
    with sink:
        pretrain(recipe, recipe_name="bench", run_dir=run_dir, progress=False)
    records = read_metrics(run_dir / "metrics.jsonl")
    steady = [r for r in records if r.step > 1]  # step 1 pays one-off costs
    return {
        "times": [r.step_time_s for r in steady],
        "waits": [r.data_wait_frac * r.step_time_s for r in steady],
        "loss": records[-1].loss,
    }


def run_bare(recipe: Recipe) -> dict:
    device = torch.device("cpu")
    loader = build_loader(recipe.data, seed=recipe.train.seed)
    model = materialize(meta_model(recipe, 1, device), device, recipe.train.seed)
    o, total = recipe.optim, recipe.train.steps
    opt = bare_adamw(decay_groups(model, o.weight_decay), o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    params, dtype = list(model.parameters()), DTYPES[recipe.train.dtype]

    def run(inputs):  # the loader's document ids and positions, when the recipe masks
        return model(inputs, **loader.attention_inputs(inputs))

    times, waits, loss_value = [], [], float("nan")
    for step in range(1, total + 1):
        start = time.perf_counter()
        lr = lr_at(step, o, total)
        set_lr(opt, lr)
        micro_batches = [(batch.inputs, batch.targets) for batch in loader.next_batch()]
        data_wait = time.perf_counter() - start
        loss, grad_norm = bare_step(
            run, params, opt, micro_batches, device=device, dtype=dtype, clip=o.grad_clip
        )
        elapsed = time.perf_counter() - start  # where the loop reads its clock at a log
        loss_value, _ = loss.item(), grad_norm.item()
        if step > 1:
            times.append(elapsed)
            waits.append(data_wait)
    return {"times": times, "waits": waits, "loss": loss_value}


# ---------------------------------------------------------------------------- driver


def describe(args: argparse.Namespace, recipe: Recipe) -> str:
    m, d = recipe.model, recipe.data
    return (
        f"bench_loop: {Path(args.recipe).name} {' '.join(args.overrides)} | "
        f"{count_parameters(m) / 1e6:.2f}M params (dim {m.dim}, {m.n_layers} layers, "
        f"vocab {m.vocab_size}) | {d.global_batch_size} x {d.seq_len} tokens/step in "
        f"micro-batches of {d.micro_batch_size} | dtype {recipe.train.dtype} | AC layers "
        f"{recipe.sharding.activation_checkpoint_layers} | {torch.get_num_threads()} threads "
        f"| {args.repeats} blocks x {args.steps} steps per contender, alternating | load "
        f"average {load_average()} on {os.cpu_count()} CPUs"
    )


def run_blocks(args: argparse.Namespace, recipe: Recipe, tmp: Path) -> dict[str, list[dict]]:
    """Every block of both contenders, alternating (the order flips every repeat)."""
    results: dict[str, list[dict]] = {YATRAIN: [], BARE: []}
    for r in range(args.repeats):
        order = [YATRAIN, BARE] if r % 2 == 0 else [BARE, YATRAIN]
        for name in order:
            if name == YATRAIN:
                res = run_yatrain(recipe, tmp / f"run-{r}", args.verbose)
            else:
                res = run_bare(recipe)
            results[name].append(res)
            print(
                f"  block {r + 1}/{args.repeats} {name:20s} median "
                f"{median(res['times']):.4f} s/step (steps {spread(res['times'])}) "
                f"data wait {sum(res['waits']) / sum(res['times']):.2%} "
                f"loss {res['loss']:.4f}",
                flush=True,
            )
    return results


def print_results(results: dict[str, list[dict]], tokens: int) -> None:
    times = {k: [t for x in v for t in x["times"]] for k, v in results.items()}
    step = {k: median(t) for k, t in times.items()}
    wait = {k: sum(w for x in v for w in x["waits"]) / sum(times[k]) for k, v in results.items()}
    rows = [
        [
            name,
            f"{step[name]:.4f}",
            spread(times[name]),
            f"{tokens / step[name]:,.0f}",
            f"{step[name] / step[BARE]:.3f}x",
            f"{wait[name]:.2%}",
            f"{v[-1]['loss']:.4f}",
        ]
        for name, v in results.items()
    ]
    headers = [
        "contender",
        "median step s",
        "step range s",
        "tokens/s",
        "ratio vs bare",
        "data wait",
        "loss at last step",
    ]
    print()
    print(table(headers, rows))
    print(f"load average at the end: {load_average()} on {os.cpu_count()} CPUs")
    ratio, frac = step[YATRAIN] / step[BARE], wait[YATRAIN]
    targets = [
        [
            "yatrain loop step time within 5% of bare (<= 1.05x)",
            f"{ratio:.3f}x",
            verdict(ratio, 1.05),
        ],
        ["yatrain data wait fraction < 2%", f"{frac:.2%}", verdict(frac, 0.02)],
    ]
    print()
    print(table(["target", "measured", "result"], targets))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-loop-") as tmp:
        tmp = Path(tmp)
        for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR"):
            os.environ.setdefault(var, str(tmp / "wandb"))
        os.environ["WANDB_MODE"] = "disabled"
        if args.data:
            data_dir = Path(args.data)
        else:
            data_dir = tmp / "data"
            t0 = time.perf_counter()
            print("preparing the stdlib corpus (vocab 4096) in a temp dir ...", flush=True)
            prepare_data(data_dir, None, vocab_size=4096, progress=False)
            print(f"  done in {time.perf_counter() - t0:.1f}s", flush=True)
        recipe = load(args, data_dir)
        print(describe(args, recipe), flush=True)
        results = run_blocks(args, recipe, tmp)
    print_results(results, recipe.data.global_batch_size * recipe.data.seq_len)
    return 0


if __name__ == "__main__":
    sys.exit(main())
