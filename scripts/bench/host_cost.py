"""Host work per step, counted rather than timed: yatrain vs FSDP2 on the same model.

On a GPU every collective, every ATen op and every CUDA event or stream wait the engine
issues costs the host microseconds; when they grow with the parameter count instead of the
layer count, the host, not the GPU, sets the step time. A CPU cannot time that honestly (its
compute hides it), but it can count it, the same way for both contenders, at world size 2
over gloo:

- collectives by kind (``bench.traffic.CommCounter``), per step and per micro-batch;
- ATen ops dispatched (a ``TorchDispatchMode`` in every Python thread that issues ops, the
  gloo reducer's helper thread included), reported as the engine's own: the contender's
  step minus a bare single-process step on the same batch;
- yatrain only, on the CUDA path run over fake streams (``yatrain.testing.cuda_standin``):
  the events recorded and the stream waits.

  python -m bench.host_cost                      # dim 1024, 4 layers, accumulation 2
  python -m bench.host_cost --dim 256 --n-layers 2 --steps 1

Targets on a model with large units (dim >= 1024): reduce-scatters per micro-batch <= units,
all-gathers per micro-batch <= 2 x units, engine ops per step <= FSDP2's, and a constant
number of events and waits per unit whatever the staging budget's piece count.
"""

from __future__ import annotations

import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench.engine.cli import parse_args
from bench.engine.contenders import BUILDERS, build_yatrain, model_config
from bench.engine.harness import rank_batches
from bench.measure import table
from bench.traffic import CommCounter
from yatrain.models.llama import layer_matmul_weights
from yatrain.testing import cuda_standin
from yatrain.testing.ranks import run_ranks

# The model: dim 1024, 4 layers of about 12M weights, accumulation 2, one layer
# checkpointed; a short sequence, since counts do not depend on it.
SHAPE = {"dim": 1024, "n-layers": 4, "n-heads": 8, "n-kv-heads": 8, "ffn-dim": 2816}
RUN = {"vocab": 8192, "seq-len": 64, "accum": 2, "ac-layers": 1, "steps": 1, "warmup": 1}
DEFAULTS = [part for key, value in {**SHAPE, **RUN}.items() for part in (f"--{key}", str(value))]
KINDS = {
    "all-gathers": CommCounter.GATHERS,
    "reduce-scatters": CommCounter.SCATTERS,
    "all-reduces": CommCounter.REDUCES,
}


class OpTally:
    """ATen ops counted from every thread while ``on``."""

    def __init__(self) -> None:
        self.ops: Counter[str] = Counter()
        self.lock = threading.Lock()
        self.on = False

    def add(self, name: str) -> None:
        with self.lock:
            self.ops[name] += 1


class _CountOps(TorchDispatchMode):
    def __init__(self, tally: OpTally) -> None:
        super().__init__()
        self.tally = tally

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if self.tally.on:
            self.tally.add(str(func))
        return func(*args, **(kwargs or {}))


@contextmanager
def counting_every_thread(tally: OpTally) -> Iterator[None]:
    """Dispatch modes are thread-local: this thread counts inside the block, and so does
    every Python thread started inside it (the gloo reducer's helper)."""
    original = threading.Thread.run

    def run(thread: threading.Thread) -> None:
        with _CountOps(tally):
            original(thread)

    threading.Thread.run = run  # type: ignore[method-assign]
    try:
        with _CountOps(tally):
            yield
    finally:
        threading.Thread.run = original  # type: ignore[method-assign]


def count_steps(step: Callable, batches: list, world: int, warmup: int) -> dict[str, Any]:
    """Collectives by kind and ATen ops per step over the steps after ``warmup``."""
    tally, comms = OpTally(), CommCounter(world)
    with counting_every_thread(tally):
        for index, micros in enumerate(batches):
            if index == warmup:
                comms.install()
                tally.on = True
            step(micros)
        tally.on = False
        comms.uninstall()
    steps = len(batches) - warmup
    counts = {kind: sum(comms.calls.get(n, 0) for n in names) for kind, names in KINDS.items()}
    result: dict[str, Any] = {kind: n / steps for kind, n in counts.items()}
    result["aten ops"] = sum(tally.ops.values()) / steps
    return result


def standin_events(o: dict, batches: list, warmup: int) -> dict[str, float]:
    """yatrain's CUDA path on fake streams: events recorded and stream waits per step."""
    with cuda_standin.patching() as patch:
        order = cuda_standin.as_if_cuda(patch)
        trainer = build_yatrain(o, torch.device("cpu"))
        for index, micros in enumerate(batches):
            if index == warmup:
                order.counts.clear()
            trainer.step(micros)
        order.active = False
    counts, steps = order.counts, len(batches) - warmup
    records = sum(n for key, n in counts.items() if key.startswith("record on "))
    waits = sum(n for key, n in counts.items() if key.startswith("wait on "))
    return {"events recorded": records / steps, "stream waits": waits / steps}


def count_rank(rank: int, world: int, o: dict, names: list[str]) -> dict[str, dict]:
    """Every contender's counts on this rank, the same batches for each."""
    device = torch.device("cpu")
    batches = rank_batches(o, rank, world, o["warmup"] + o["steps"], device)
    found = {}
    for name in ("bare", *names):
        trainer = BUILDERS[name](o, device)
        found[name] = count_steps(trainer.step, batches, world, o["warmup"])
        if name == "yatrain":
            found[name]["units"] = trainer.extra["units"]
            found[name].update(standin_events(o, batches, o["warmup"]))
    for name in names:
        found[name]["engine ops"] = found[name]["aten ops"] - found["bare"]["aten ops"]
    return found


def measure(o: dict, names: list[str], world: int) -> dict[str, dict]:
    """Rank 0's counts (every rank issues the same collectives and ops)."""
    return run_ranks(world, count_rank, o, names, threads=1)[0]


def report(found: dict[str, dict], accum: int) -> list[str]:
    """The side-by-side table, then the targets with their verdicts."""
    names = [n for n in found if n != "bare"]
    rows = []
    keys = [*KINDS, "engine ops", "events recorded", "stream waits"]
    for key in keys:
        values = [found[n].get(key) for n in names]
        cells = ["-" if v is None else f"{v:,.0f}" for v in values]
        ratio = "-"
        if len(values) == 2 and None not in values and values[1]:
            ratio = f"{values[0] / values[1]:.2f}x"
        rows.append([f"{key} per step", *cells, ratio])
    lines = table(["", *names, " / ".join(names)], rows).splitlines()
    mine = found["yatrain"]
    units = mine["units"]
    checks = [
        ("reduce-scatters per micro-batch <= units", (mine["reduce-scatters"] - 1) / accum, units),
        ("all-gathers per micro-batch <= 2 x units", mine["all-gathers"] / accum, 2 * units),
    ]
    if "fsdp2" in found:
        fsdp2 = found["fsdp2"]["engine ops"]
        checks.append(("engine ops per step <= FSDP2's", mine["engine ops"], fsdp2))
    for text, value, bound in checks:
        verdict = "ok" if value <= bound else "MISSED"
        lines.append(f"{text}: {value:,.1f} vs {bound:,.0f}: {verdict}")
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args([*DEFAULTS, *argv, "--contenders", "yatrain,fsdp2"])
    o = vars(args)
    if args.world_size < 2 or args.device != "cpu":
        print("host_cost: counts on CPU at world size >= 2 (gloo)", file=sys.stderr)
        return 1
    found = measure(o, args.contenders, args.world_size)
    layer = layer_matmul_weights(model_config(o))
    print(
        f"host_cost: world {args.world_size}, cpu (gloo), dim {args.dim} x {args.n_layers} layers"
        f" ({layer / 1e6:.1f}M weights a layer), "
        f"{args.dtype} weights, {args.reduce_dtype} reduction, accumulation {args.accum}, "
        f"{args.ac_layers} checkpointed layer(s); counts per step of rank 0 "
        "(the norm group adds one reduce-scatter and one all-gather a step)"
    )
    print("\n".join(report(found, args.accum)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
