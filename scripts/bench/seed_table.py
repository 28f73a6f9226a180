"""The memory planner's answer for every row of YaFSDP's published benchmark table.

Each row: A100 80GB, the row's GPU count and sequence length, one sequence per GPU, bf16
weights with fp32 reduce-scatter (the published setup), the default runtime allowance. Prints
a Markdown table with the number of first layers the planner would checkpoint beside the
number the published run checkpointed.

    python scripts/plan_seed_table.py [--gpu-memory 80] [--runtime-allowance GiB]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from yatrain.common import GIB, format_bytes
from yatrain.plan import plan_for_layers, plan_memory
from yatrain.recipe.load import load_recipe

REPO = Path(__file__).resolve().parents[2]

# (model, recipe, GPUs, sequence length, layers the published run checkpointed)
SEED_ROWS = [
    ("Llama 2 7B", "llama2_7b", 64, 2048, 0),
    ("Llama 2 7B", "llama2_7b", 64, 4096, 0),
    ("Llama 2 7B", "llama2_7b", 64, 8192, 0),
    ("Llama 2 7B", "llama2_7b", 128, 2048, 0),
    ("Llama 2 7B", "llama2_7b", 128, 4096, 0),
    ("Llama 2 7B", "llama2_7b", 128, 8192, 0),
    ("Llama 2 13B", "llama2_13b", 128, 2048, 0),
    ("Llama 2 13B", "llama2_13b", 128, 4096, 0),
    ("Llama 2 34B", "llama2_34b", 128, 2048, 0),
    ("Llama 2 34B", "llama2_34b", 256, 2048, 0),
    ("Llama 2 34B", "llama2_34b", 256, 4096, 5),
    ("Llama 2 70B", "llama2_70b", 256, 2048, 10),
    ("Llama 2 70B", "llama2_70b", 256, 4096, 50),
    ("Llama 3 8B", "llama3_8b", 64, 2048, 0),
    ("Llama 3 8B", "llama3_8b", 64, 4096, 0),
    ("Llama 3 70B", "llama3_70b", 256, 2048, 20),
]


def row_recipe(recipe: str, gpus: int, seq: int):
    """The published setup on our recipe: micro-batch 1, bf16, fp32 reduce, 2 layer buffers.
    Llama 2 7B's 8192 rows run past its 4096 context (rotary positions allow it)."""
    overrides = [
        f"data.seq_len={seq}",
        f"model.max_seq_len={seq}",
        "data.micro_batch_size=1",
        f"data.global_batch_size={gpus}",
        "train.dtype=bf16",
        "sharding.reduce_dtype=fp32",
        "sharding.prefetch_depth=1",
        "sharding.activation_checkpoint_layers=0",
    ]
    return load_recipe(REPO / "recipes" / f"{recipe}.yaml", overrides)


def _gib(n: int) -> str:
    return format_bytes(n, "GiB", digits=1, suffix=False)


def table(gpu_memory_gib: float, allowance_gib: float | None) -> str:
    limit = int(gpu_memory_gib * GIB)
    allowance = None if allowance_gib is None else int(allowance_gib * GIB)
    lines = [
        "| model | GPUs | seq | seed ckpt layers | planner ckpt layers | planner peak GiB | "
        "recompute | peak GiB at seed's layers |",
        "|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for model, recipe_name, gpus, seq, seed_layers in SEED_ROWS:
        recipe = row_recipe(recipe_name, gpus, seq)
        plan = plan_memory(recipe, gpus, limit, allowance)
        at_seed = plan_for_layers(recipe, gpus, seed_layers, limit, allowance)
        layers = str(plan.activation_checkpoint_layers)
        if not plan.fits:
            layers = f"does not fit (needs {plan.min_gpus} GPUs)"
        seed_fit = "fits" if at_seed.fits else "over"
        lines.append(
            f"| {model} | {gpus} | {seq} | {seed_layers} | {layers} | "
            f"{_gib(plan.peak_bytes_per_gpu)} | {plan.recompute_flops_fraction:.1%} | "
            f"{_gib(at_seed.peak_bytes_per_gpu)} ({seed_fit}) |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu-memory", type=float, default=80.0, help="GiB per GPU (80)")
    parser.add_argument(
        "--runtime-allowance", type=float, default=None, help="GiB (default: 2 + 5%% of memory)"
    )
    args = parser.parse_args(argv)
    print(table(args.gpu_memory, args.runtime_allowance))


if __name__ == "__main__":
    main()
