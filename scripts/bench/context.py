"""Memory and traffic of context parallelism: one training step per rank with each window
whole on its rank (CP 1) and cut over CP ranks, side by side, on the same world size.

Each contender runs in fresh rank processes (``testing.ranks``, gloo on CPU): the recipe's
model and engine (``train.build``), one sequence per data rank (CP 1 at world 2: two data
ranks; CP 2: one), one warm-up step (AdamW's state), then one measured step. Per rank it
reports the live-tensor peak of that step (``plan.LiveTensorTracker``, every tensor alive
at its start adopted: weights, buffers, optimizer state), the process's resident peak
(VmHWM, reset before the step: it includes the ~0.4 GiB a rank holds before its first step),
that peak above the resident size before the model was built (what the run adds, the engine
benchmark's ``peak mem/rank``) and above the resident size at the step's start; the bytes
the K/V collectives sent, as counted by the context group (the ``ContextParallel.bytes_sent``
a run logs), as the formula says (per layer per micro-batch one all-gather and one
reduce-scatter of the local keys and values, (CP - 1) local copies each) and as counted
independently by wrapping the ``torch.distributed`` collectives on the CP group
(``bench.traffic.CommCounter``).

    python scripts/bench_context.py                     # 8192 tokens, dim 256, 4 layers
    python scripts/bench_context.py --seq-len 2048 --cp 2 4 --world 4
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch

from bench.measure import hwm_bytes, reset_hwm, rss_bytes, table, trim_heap, verdict
from bench.traffic import CommCounter
from yatrain.common import format_bytes
from yatrain.context_parallel.split import ContextParallel
from yatrain.plan import LiveTensorTracker
from yatrain.recipe.config import Recipe
from yatrain.recipe.load import load_recipe
from yatrain.recipe.topology import job_layout
from yatrain.runtime.process import Runtime
from yatrain.testing.ranks import run_ranks
from yatrain.train.build import build_model_and_engine
from yatrain.train.optim import build_optimizer
from yatrain.train.step import train_step

REPO = Path(__file__).resolve().parents[2]
LIMIT = 0.6  # the bound: CP 2's per-rank peak at most 0.6x CP 1's


def contender(recipe_path: str, overrides: list[str], seq_len: int, cp: int, world: int):
    """The recipe at ``seq_len`` tokens, CP ``cp``, one sequence per data rank, nothing
    checkpointed, fp32."""
    sets = [
        *overrides,  # the contender's own settings below win
        f"model.max_seq_len={seq_len}",
        f"data.seq_len={seq_len}",
        "data.micro_batch_size=1",
        f"data.global_batch_size={world // cp}",
        f"sharding.context_parallel={cp}",
        "sharding.activation_checkpoint_layers=0",
        "train.dtype=fp32",
    ]
    return load_recipe(recipe_path, sets)


def kv_formula(recipe: Recipe, cp: int) -> int:
    """Bytes one rank's K/V collectives send in a step of one micro-batch: per layer one
    all-gather and one reduce-scatter, each sending (CP - 1) copies of this rank's fp32 keys
    and values [2, micro, kv heads, seq_len / CP, head dim]."""
    m, d = recipe.model, recipe.data
    local = 2 * d.micro_batch_size * m.n_kv_heads * (d.seq_len // cp) * m.head_dim * 4
    return m.n_layers * 2 * (cp - 1) * local


class GroupCounter(CommCounter):
    """``CommCounter`` for the collectives of one process group only (the CP group's)."""

    def __init__(self, world_size: int, group: object) -> None:
        super().__init__(world_size)
        self.group = group

    def _count(self, name: str, args: tuple, kwargs: dict) -> None:
        if self.group is not None and kwargs.get("group") is self.group:
            super()._count(name, args, kwargs)


def measure(rank: int, world: int, recipe: Recipe) -> dict:
    """One rank: a warm-up step, then the measured one (see the module docstring)."""
    trim_heap()
    before_build = rss_bytes()
    runtime = Runtime.of_caller_group(torch.device("cpu"))
    layout = job_layout(recipe, runtime.world_size, runtime.local_world_size)
    context = ContextParallel.of_layout(layout, runtime.device)
    model, engine = build_model_and_engine(recipe, runtime, layout=layout)
    optimizer = build_optimizer(engine.param_groups(0.1), recipe.optim)
    cp = context.size if context is not None else 1
    gen = torch.Generator().manual_seed(0)
    seq, vocab = recipe.data.seq_len, recipe.model.vocab_size
    windows = torch.randint(0, vocab, (recipe.data.global_batch_size, seq + 1), generator=gen)
    mine = windows[rank // cp : rank // cp + 1]
    micro = [(mine[:, :-1], mine[:, 1:])]

    def step() -> None:
        train_step(model, engine, optimizer, micro, grad_clip=1.0, context=context)

    step()
    trim_heap()
    reset_hwm()
    start_rss = rss_bytes()
    kv_before = context.bytes_sent if context else 0
    counter = GroupCounter(world, context.group.comm.group if context else None).install()
    with LiveTensorTracker("cpu") as tracker:
        tracker.adopt(o for o in gc.get_objects() if issubclass(type(o), torch.Tensor))
        tracker.reset_peak()
        step()
    counter.uninstall()
    kv = (context.bytes_sent if context else 0) - kv_before
    return {
        "live_peak": tracker.peak,
        "rss_peak": hwm_bytes(),
        "rss_start": start_rss,
        "rss_before_build": before_build,
        "kv_counted": kv,
        "kv_formula": kv_formula(recipe, cp),
        "kv_wrapped": counter.bytes_sent,
        "tokens": micro[0][0].numel() // cp,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default=str(REPO / "recipes" / "tiny.yaml"))
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--cp", type=int, nargs="+", default=[2], help="CP sizes beside CP 1")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args(argv)
    rows, floors, base = [], [], None
    for cp in [1, *args.cp]:
        recipe = contender(args.recipe, args.overrides, args.seq_len, cp, args.world)
        ranks = run_ranks(args.world, measure, recipe, threads=args.threads)
        peaks = peak_columns(ranks)
        base = base or peaks
        exact = all(r["kv_counted"] == r["kv_formula"] == r["kv_wrapped"] for r in ranks)
        row = [f"CP {cp}", ranks[0]["tokens"]]
        for value, first in zip(peaks, base, strict=True):
            row += [format_bytes(value, "MiB", digits=1), f"{value / first:.3f}x"]
        row += [format_bytes(ranks[0]["kv_counted"], "MiB", digits=2), "yes" if exact else "NO"]
        row += [verdict(peaks[i] / base[i], LIMIT) if cp == 2 else "" for i in (0, 1)]
        rows.append(row)
        before, start = ranks[0]["rss_before_build"] or 0, ranks[0]["rss_start"] or 0
        floors.append(
            f"CP {cp}: {format_bytes(before, 'MiB', digits=0)} before the model (Python, torch, "
            f"gloo), {format_bytes(start - before, 'MiB', digits=0)} more from the build and the "
            "warm-up step (weights, AdamW state, modules imported)"
        )
    m = recipe.model
    print(
        f"bench_context: {Path(args.recipe).name} dim {m.dim}, {m.n_layers} layers, "
        f"{m.n_heads}/{m.n_kv_heads} heads | {args.seq_len} tokens per sequence, one sequence "
        f"per data rank | world {args.world} | fp32 | {args.threads} thread(s) per rank"
    )
    headers = ["contender", "tokens/rank", "live peak", "vs CP 1", "RSS peak", "vs CP 1"]
    headers += ["RSS peak above pre-build", "vs CP 1", "RSS rise in step", "vs CP 1"]
    headers += ["K/V sent/step", "= formula = wrapped", f"live <= {LIMIT}x", f"RSS <= {LIMIT}x"]
    print(table(headers, rows))
    print("resident before the measured step, the same whatever the CP size: " + "; ".join(floors))
    return 0


def peak_columns(ranks: list[dict]) -> tuple[int, int, int, int]:
    """The largest rank's (live-tensor peak, process RSS peak, RSS peak above the RSS before
    the model was built, RSS rise in the measured step)."""
    rss = [r["rss_peak"] or 0 for r in ranks]
    return (
        max(r["live_peak"] for r in ranks),
        max(rss),
        max(p - (r["rss_before_build"] or 0) for p, r in zip(rss, ranks, strict=True)),
        max(p - (r["rss_start"] or 0) for p, r in zip(rss, ranks, strict=True)),
    )


if __name__ == "__main__":
    sys.exit(main())
