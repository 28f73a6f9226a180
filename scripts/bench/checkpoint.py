"""Time checkpoint save and load, and report checkpoint size, for a recipe's model.

    python scripts/bench_checkpoint.py recipes/tiny.yaml
    python scripts/bench_checkpoint.py recipes/tiny.yaml --set model.dim=768 \\
        --set model.n_layers=12 --set model.n_heads=12 --set model.n_kv_heads=4 \\
        --set model.ffn_dim=2048 --set model.vocab_size=32000

One process (world size 1), fp32 master weights plus AdamW moments, the same code path the
training loop uses (`yatrain.checkpoint.store`). Prints median seconds over --repeats: the
save; DCP's write with XXH3-64 of every file computed as it is written beside a plain DCP
write of the same state, interleaved (which goes first alternates); the checksum
verification before a load; the load; and the hash's own cost per GiB. Then how long a
save stops training, synchronous vs ``checkpoint.async`` (``checkpoint_stall``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import tempfile
import time
import warnings
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import xxhash

from bench.checkpoint_stall import measure
from bench.checkpoint_stall import report as stall_report
from yatrain.checkpoint import store as ckpt
from yatrain.checkpoint.dcp_io import save_state
from yatrain.checkpoint.manifest import open_checkpoint
from yatrain.checkpoint.optimizer_state import ensure_state
from yatrain.common import format_bytes
from yatrain.models.llama import count_parameters
from yatrain.recipe.load import load_recipe
from yatrain.runtime.process import Runtime
from yatrain.train.build import build_model_and_engine
from yatrain.train.optim import build_optimizer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe")
    parser.add_argument("--set", action="append", default=[], dest="overrides")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--stall-repeats", type=int, default=3, help="0: skip the stall part")
    parser.add_argument("--after", type=int, default=10, help="steps timed after a save")
    parser.add_argument("--step-sequences", type=int, default=1, help="sequences per step")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(2)
    cfg = load_recipe(args.recipe, args.overrides)
    _, engine = build_model_and_engine(cfg, Runtime(0, 1, 0, torch.device("cpu")))
    optimizer = build_optimizer(engine.param_groups(0.1), cfg.optim)
    ensure_state(optimizer)
    saves, hashed, plain, verifies, loads = [], [], [], [], []
    with tempfile.TemporaryDirectory() as root:
        for repeat in range(args.repeats):
            start = time.perf_counter()
            meta = {"model": dataclasses.asdict(cfg.model)}
            path = ckpt.save_checkpoint(
                Path(root), repeat + 1, engine, optimizer, None, meta, is_main=True, keep=1
            )
            saves.append(time.perf_counter() - start)
            # Alternate which goes first: the first write after a save is slower either way.
            for hashing in (True, False) if repeat % 2 else (False, True):
                seconds = _timed_write(engine, optimizer, Path(root) / "w", hashing=hashing)
                (hashed if hashing else plain).append(seconds)
            start = time.perf_counter()
            open_checkpoint(path, cfg.model, verify=False)
            checked = time.perf_counter()
            open_checkpoint(path, cfg.model)  # the same, plus every checksum
            verifies.append(time.perf_counter() - checked - (checked - start))
            start = time.perf_counter()
            ckpt.load_checkpoint(path, engine, optimizer, None)
            loads.append(time.perf_counter() - start)
        size = sum(f.stat().st_size for f in path.iterdir())
    report(args, cfg, size, saves, hashed, plain, verifies, loads)
    if args.stall_repeats:
        del engine, optimizer
        with tempfile.TemporaryDirectory() as root:
            trial = measure(
                cfg,
                Path(root),
                repeats=args.stall_repeats,
                after=args.after,
                sequences=args.step_sequences,
            )
        stall_report(trial, args.after)


def _timed_write(engine, optimizer, folder: Path, hashing: bool) -> float:
    """Seconds to write the training state with DCP, with or without the XXH3-64 pass."""
    state = ckpt.training_state(engine, optimizer, None)
    start = time.perf_counter()
    if hashing:
        save_state(state, folder)
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        dcp.save(state, checkpoint_id=str(folder))
        dist.destroy_process_group()
    seconds = time.perf_counter() - start
    shutil.rmtree(folder)
    return seconds


def hash_cost(size: int = 256 * 2**20, trials: int = 5) -> dict[str, float]:
    """Seconds per GiB of XXH3-64 (what checkpoints use) and zlib's CRC32, best of trials."""
    data = memoryview(os.urandom(size))
    costs = {}
    hashes = {"XXH3-64": lambda: xxhash.xxh3_64(data).digest(), "CRC32": lambda: zlib.crc32(data)}
    for name, fn in hashes.items():
        best = float("inf")
        for _ in range(trials):
            start = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - start)
        costs[name] = best * 2**30 / size
    return costs


def report(args, cfg, size, saves, hashed, plain, verifies, loads) -> None:
    params = count_parameters(cfg.model)
    gib = size / 2**30
    median = statistics.median
    print(f"model: {params / 1e6:.1f}M parameters ({args.recipe} {' '.join(args.overrides)})")
    print(
        f"checkpoint size: {format_bytes(size, 'MiB', digits=1)} "
        f"({size / params:.1f} bytes/parameter)"
    )
    print(f"save: {median(saves):.2f} s (all of save_checkpoint), median of {args.repeats}")
    for name, pick in (("median", median), ("best", min)):
        print(
            f"DCP write, {name}: {pick(hashed):.2f} s hashing each file as written, "
            f"{pick(plain):.2f} s plain ({pick(hashed) / pick(plain):.2f}x)"
        )
    print(f"verify: {median(verifies):.2f} s ({median(verifies) / gib:.3f} s/GiB, warm cache)")
    costs = ", ".join(f"{name} {seconds:.3f} s/GiB" for name, seconds in hash_cost().items())
    print(f"hash alone, one core, in memory: {costs}")
    print(f"load: {median(loads):.2f} s median of {args.repeats} (checksums not included)")


if __name__ == "__main__":
    main()
