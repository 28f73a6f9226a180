"""Does the engine's buffered path train like a bare PyTorch step on this one device?

At world size 1 the engine computes straight from its shard, so a one-GPU benchmark never
runs its gather and gradient buffers, its reduce-scatter pieces or its communication stream.
``force_process_group`` runs all of them in a one-rank process group (NCCL on CUDA, gloo on
CPU). This check trains the same model from the same weights on the same batches three
ways, one step of each in turn, and compares every step's loss:

- ``yatrain-pg`` (the buffered path) against ``yatrain`` (the direct path): the same
  arithmetic in the same order. In deterministic mode (the default: ``train.deterministic``'s
  kernels in the rank) the losses must be identical, bit for bit, on a GPU too; with
  ``--nondeterministic`` a GPU's kernels may sum in another order on each call, so the
  drift is reported and held to ``--tolerance`` instead;
- ``yatrain-pg`` against ``bare`` (plain PyTorch; autocast in bf16): within ``--tolerance``
  (relative), since autocast rounds differently from bf16 weights.

  python -m bench.pathcheck --device cuda [model flags as bench.engine]

Exits 1, printing the table, when either comparison fails; ``scripts/bench_gpu.sh`` runs it
before its timings.
"""

from __future__ import annotations

import sys

import torch

from bench.engine.cli import parse_args
from bench.engine.contenders import BUILDERS
from bench.engine.harness import rank_batches, rank_device
from bench.measure import table
from yatrain.runtime.determinism import deterministic_cublas
from yatrain.testing.ranks import run_ranks

CONTENDERS = ("bare", "yatrain", "yatrain-pg")
DEFAULT_TOLERANCE = 0.01  # bf16 weights vs autocast: measured 0.1-0.3% over a few steps


def _losses(rank: int, world: int, o: dict) -> dict[str, list[float]]:
    device = rank_device(o, rank)  # deterministic kernels when asked
    batches = rank_batches(o, rank, world, o["steps"], device)
    trainers = {name: BUILDERS[name](o, device) for name in CONTENDERS}
    losses: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    for micros in batches:
        for name, trainer in trainers.items():
            losses[name].append(float(trainer.step(micros)))
    return losses


def check(
    losses: dict[str, list[float]], tolerance: float, bitwise: bool = True
) -> tuple[bool, str]:
    """(passed, the per-step table): the buffered path equals the direct one (``bitwise``;
    else within ``tolerance``) and is within ``tolerance`` of the bare step."""
    rows, passed = [], True
    for step, (bare, direct, forced) in enumerate(
        zip(*(losses[c] for c in CONTENDERS), strict=True), 1
    ):
        rel = abs(forced - bare) / abs(bare)
        drift = abs(forced - direct) / abs(direct)
        same = forced == direct if bitwise else drift <= tolerance
        passed &= same and rel <= tolerance
        row = [step, f"{bare:.6f}", f"{direct:.6f}", f"{forced:.6f}"]
        rows.append([*row, "yes" if same else "NO", f"{drift:.2e}", f"{rel:.2e}"])
    headers = ["step", "bare", "yatrain (direct)", "yatrain-pg (buffered)"]
    wanted = "pg == direct" if bitwise else "pg ~ direct"
    headers += [wanted, "|pg - direct| / direct", "|pg - bare| / bare"]
    return passed, table(headers, rows)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    tolerance = DEFAULT_TOLERANCE
    if "--tolerance" in argv:
        at = argv.index("--tolerance")
        tolerance = float(argv[at + 1])
        del argv[at : at + 2]
    deterministic = "--nondeterministic" not in argv
    argv = [a for a in argv if a not in ("--nondeterministic", "--deterministic")]
    extra = ["--deterministic"] if deterministic else []
    args = parse_args([*argv, *extra, "--world-size", "1", "--contenders", ",".join(CONTENDERS)])
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: --device cuda needs a GPU", file=sys.stderr)
        return 1
    o = {k: v for k, v in vars(args).items() if k != "contenders"}
    o["steps"] = args.warmup + args.steps
    backend = "nccl" if args.device == "cuda" else "gloo"
    if deterministic:
        deterministic_cublas()  # inherited by a spawned rank before it starts CUDA
    losses = run_ranks(
        1, _losses, o, backend=backend, threads=args.threads, start_method=args.start_method
    )[0]
    passed, text = check(losses, tolerance, bitwise=deterministic)
    mode = "deterministic kernels" if deterministic else "nondeterministic kernels"
    print(
        f"pathcheck: {args.device}, {args.dtype} weights, {args.reduce_dtype} reduce, "
        f"one rank in a process group, {o['steps']} steps, {mode}, tolerance {tolerance:g}"
    )
    print(text)
    print("pathcheck: PASS" if passed else "pathcheck: FAIL (see the table)")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
