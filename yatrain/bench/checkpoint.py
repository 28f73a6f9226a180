"""Time checkpoint save and load, and report checkpoint size, for a recipe's model.

    python scripts/bench_checkpoint.py recipes/tiny.yaml
    python scripts/bench_checkpoint.py recipes/tiny.yaml --set model.dim=768 \\
        --set model.n_layers=12 --set model.n_heads=12 --set model.n_kv_heads=4 \\
        --set model.ffn_dim=2048 --set model.vocab_size=32000

One process (world size 1), fp32 master weights plus AdamW moments, the same code path the
training loop uses (`yatrain.train.checkpoint`). Prints median seconds over --repeats.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch

from yatrain.common import format_bytes
from yatrain.config import load_recipe
from yatrain.models.llama import build_model, count_parameters
from yatrain.sharding import ShardedEngine
from yatrain.train import checkpoint as ckpt
from yatrain.train.optim import build_optimizer, ensure_state


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe")
    parser.add_argument("--set", action="append", default=[], dest="overrides")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(2)
    cfg = load_recipe(args.recipe, args.overrides)
    engine = ShardedEngine.from_model(build_model(cfg.model), device="cpu")
    optimizer = build_optimizer(engine.param_groups(0.1), cfg.optim)
    ensure_state(optimizer)
    saves, loads = [], []
    with tempfile.TemporaryDirectory() as root:
        for repeat in range(args.repeats):
            start = time.perf_counter()
            path = ckpt.save_checkpoint(
                Path(root), repeat + 1, engine, optimizer, None,
                {"model": dataclasses.asdict(cfg.model)}, is_main=True, keep=1,
            )  # fmt: skip
            saves.append(time.perf_counter() - start)
            start = time.perf_counter()
            ckpt.open_checkpoint(path, cfg.model)  # sizes and checksums
            ckpt.load_checkpoint(path, engine, optimizer, None)
            loads.append(time.perf_counter() - start)
        size = sum(f.stat().st_size for f in path.iterdir())
    params = count_parameters(cfg.model)
    print(f"model: {params / 1e6:.1f}M parameters ({args.recipe} {' '.join(args.overrides)})")
    print(
        f"checkpoint size: {format_bytes(size, 'MiB', digits=1)} "
        f"({size / params:.1f} bytes/parameter)"
    )
    print(f"save: {statistics.median(saves):.2f} s median of {args.repeats} (incl. crc32)")
    print(f"load: {statistics.median(loads):.2f} s median of {args.repeats} (incl. validation)")


if __name__ == "__main__":
    main()
