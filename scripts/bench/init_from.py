"""Start-up of ``train.init_from`` from a Hugging Face directory: bytes each rank reads and
its peak host memory, at world sizes 1, 2 and 4 (gloo ranks on this machine).

The directory is written here, in Hugging Face's layout and bf16 as published (random
weights of a Llama whose units span several safetensors files: ``--shard-mb``). Each rank
builds the engine from it (``init_from_source``) and reports:

- bytes read: what its safetensors slices held (``HFSource.bytes_read``), against its share
  of the model, ``(all tensors - norms) / world + norms``;
- extra memory: peak RSS while the engine is built (VmHWM, reset through
  ``/proc/self/clear_refs`` just before) minus the RSS before it and minus the rank's fp32
  master shards, against the model's largest unit in fp32.

    python scripts/bench_init_from.py [--dim 1024 --layers 4 --vocab 32000 --shard-mb 50]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from yatrain.models import hf
from yatrain.models.llama import materialize
from yatrain.recipe.config import DataConfig, ModelConfig, OptimConfig, Recipe, TrainConfig
from yatrain.runtime.process import Runtime
from yatrain.testing.ranks import run_ranks
from yatrain.train.build import meta_model, recipe_init, shard_model

MIB = 2**20


def write_hf_dir(cfg: ModelConfig, folder: Path, shard_bytes: int) -> int:
    """A random model as a Hugging Face directory of bf16 safetensors; its tensor bytes."""
    model = materialize(meta_model(cfg), "cpu", seed=0)
    files: list[dict[str, torch.Tensor]] = [{}]
    size = total = 0
    for name, tensor in model.state_dict().items():
        if cfg.tie_embeddings and name == "output.weight":
            continue
        key, value = hf.to_hf(name, tensor.to(torch.bfloat16), cfg)
        if size and size + value.nbytes > shard_bytes:
            files.append({})
            size = 0
        files[-1][key] = value
        size, total = size + value.nbytes, total + value.nbytes
    weight_map = {}
    for number, tensors in enumerate(files, start=1):
        name = f"model-{number:05d}-of-{len(files):05d}.safetensors"
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "config.json").write_text(json.dumps(hf.hf_config(cfg, "bf16", 1, 2)))
    return total


def _status(field: str) -> int:
    """A ``VmRSS``/``VmHWM`` line of /proc/self/status, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def init_recipe(cfg: ModelConfig, folder: Path, world: int) -> Recipe:
    """A run that starts from ``folder``: fp32 weights, one sequence per rank."""
    return Recipe(
        model=cfg,
        data=DataConfig(seq_len=cfg.max_seq_len, micro_batch_size=1, global_batch_size=world),
        train=TrainConfig(steps=1, dtype="fp32", init_from=str(folder)),
        optim=OptimConfig(lr=1e-4),
    )


def _measure(rank: int, world: int, cfg: ModelConfig, folder: Path) -> dict:
    recipe = init_recipe(cfg, folder, world)
    runtime = Runtime.of_caller_group(torch.device("cpu"))
    model = meta_model(recipe, world)
    init = recipe_init(model, recipe, runtime)
    Path("/proc/self/clear_refs").write_text("5")  # the peak RSS starts again from here
    before = _status("VmRSS")
    engine = shard_model(model, recipe, runtime, init=init)
    peak = _status("VmHWM")
    master = 4 * (engine.shards.master.numel() + engine.shards.small_master.numel())
    largest = max(4 * layout.numel for layout in engine.layouts)
    return {
        "rank": rank,
        "bytes_read": init.report.__self__.bytes_read,
        "extra_bytes": peak - before - master,
        "largest_unit_fp32": largest,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=2816)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--tied", action="store_true", help="tie the head to the embedding")
    parser.add_argument("--shard-mb", type=int, default=50, help="safetensors file size")
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args(argv)
    cfg = ModelConfig(
        dim=args.dim,
        n_layers=args.layers,
        n_heads=args.dim // 128,
        n_kv_heads=2,
        ffn_dim=args.ffn,
        vocab_size=args.vocab,
        max_seq_len=8192,
        rope_theta=5e5,
        tie_embeddings=args.tied,
    )
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        total = write_hf_dir(cfg, folder, args.shard_mb * MIB)
        n_files = len(list(folder.glob("*.safetensors")))
        norms = 2 * cfg.dim * (2 * cfg.n_layers + 1)
        print(f"model: {total / MIB:.1f} MiB of bf16 tensors in {n_files} files")
        print("world rank  read MiB  share MiB  read/share  extra MiB  largest unit MiB  ratio")
        for world in args.worlds:
            for r in run_ranks(world, _measure, cfg, folder):
                share = (total - norms) / world + norms
                print(
                    f"{world:5d} {r['rank']:4d} {r['bytes_read'] / MIB:9.1f} {share / MIB:10.1f} "
                    f"{r['bytes_read'] / share:11.3f} {r['extra_bytes'] / MIB:10.1f} "
                    f"{r['largest_unit_fp32'] / MIB:17.1f} "
                    f"{r['extra_bytes'] / r['largest_unit_fp32']:6.2f}"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
