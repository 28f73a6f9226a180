"""The ``yatrain plan`` and ``yatrain sweep`` commands (registered on the app in cli.py).

Thin wrappers: flags in, planner or sweep out; user errors raise ``ConfigError`` so the CLI
prints them as one line.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer

from yatrain.errors import ConfigError

ASSUMED_GPU_GIB = 80.0  # A100/H100 80GB class, when nothing says otherwise

# For app.command("plan", epilog=PLAN_EXAMPLES)(plan) and likewise for sweep.
PLAN_EXAMPLES = (
    "Examples:\n\n"
    "  yatrain plan recipes/llama3_70b.yaml --gpus 256 --set data.seq_len=2048\n\n"
    "  yatrain plan recipes/llama3_8b.yaml --gpus 8 --gpu-memory 80 --json"
)
SWEEP_EXAMPLES = (
    "Examples:\n\n"
    "  yatrain sweep recipes/tiny.yaml --seq-len 64,128,256 --activation-checkpoint-layers 0,4\n\n"
    "  yatrain sweep recipes/llama3_8b.yaml --seq-len 2048,4096,8192 "
    "--activation-checkpoint-layers 0,auto --nproc-per-node 8 --output runs/sweep-8b"
)

LABELS = {
    "master_weights": "fp32 master weights (shard)",
    "gradients": "fp32 gradients (shard)",
    "optimizer_state": "AdamW moments (2 x fp32 shard)",
    "gather_input_copy": "bf16 gather-input copy (shard)",
    "gather_buffers": "gather buffers (layers, edge, norms)",
    "gradient_buffers": "gradient buffers (+ staging, RS out)",
    "batch_and_rope": "token ids and rotary tables",
    "activations": "activations",
    "logits_and_loss": "logits and loss",
    "backward_workspace": "backward / grad-norm workspace",
    "runtime_allowance": "runtime allowance (CUDA, NCCL, frag.)",
}


def _memory_limit(gpu_memory: float | None, recipe) -> tuple[int, str]:
    """Bytes per GPU to plan against, and where the figure comes from."""
    import torch

    from yatrain.plan.memory import GIB

    if gpu_memory is not None:
        return int(gpu_memory * GIB), "--gpu-memory"
    if recipe.sharding.gpu_memory_gib is not None:
        return int(recipe.sharding.gpu_memory_gib * GIB), "sharding.gpu_memory_gib"
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory, torch.cuda.get_device_name(0)
    return int(ASSUMED_GPU_GIB * GIB), "assumed: no GPU here, pass --gpu-memory"


def format_plan(plan, recipe, recipe_path: Path, source: str) -> str:
    """The human-readable report of ``yatrain plan``."""
    from yatrain.models.llama import count_parameters
    from yatrain.plan.memory import GIB, explain

    m, k, n = recipe.model, plan.activation_checkpoint_layers, plan.n_layers
    params = count_parameters(m) / 1e9
    head = (
        f"{recipe_path.name}: {params:.2f}B parameters, {n} layers | seq {plan.seq_len} x "
        f"micro-batch {plan.micro_batch_size} | {plan.dtype} weights, "
        f"{recipe.sharding.reduce_dtype} reduce\n{plan.world_size} GPUs x "
        f"{plan.gpu_memory_bytes / GIB:.2f} GiB ({source})"
    )
    full, ckpt = plan.full_layer_bytes / GIB, plan.checkpointed_layer_bytes / GIB
    if plan.peak_moment.startswith("recompute"):
        acts = f"activations ({k} ckpt inputs + 1 recomputed layer)"
    elif plan.peak_moment == "gradient norm":
        acts = "activations (all freed by then)"
    else:
        acts = f"activations ({n - k} full + {k} checkpointed)"
    lines = [head, f"per-GPU memory, first {k} of {n} layers checkpointed (peak at: "
             f"{plan.peak_moment})"]  # fmt: skip
    for key, value in plan.breakdown.items():
        label = acts if key == "activations" else LABELS.get(key, key)
        lines.append(f"  {label:<44} {value / GIB:>8.2f} GiB")
    verdict = "fits" if plan.fits else "DOES NOT FIT"
    lines += [
        "  " + "-" * 57,
        f"  {'peak':<44} {plan.peak_bytes_per_gpu / GIB:>8.2f} GiB of "
        f"{plan.gpu_memory_bytes / GIB:.2f}: {verdict}",
        f"per decoder layer: {full:.3f} GiB of activations, {ckpt:.3f} GiB when checkpointed",
        f"answer: {explain(plan)}",
    ]
    own = plan.recipe_setting
    if own.get("activation_checkpoint_layers") not in (None, "auto"):
        state = "fits" if own["fits"] else "does not fit"
        lines.append(
            f"recipe: activation_checkpoint_layers {own['activation_checkpoint_layers']} -> "
            f"peak {own['peak_bytes_per_gpu'] / GIB:.2f} GiB ({state})"
        )
    return "\n".join(lines)


def plan(
    recipe: Path = typer.Argument(..., help="Recipe YAML, e.g. recipes/llama3_8b.yaml."),
    gpus: int = typer.Option(..., "--gpus", min=1, help="Number of GPUs (data-parallel ranks)."),
    gpu_memory: float | None = typer.Option(
        None, "--gpu-memory", min=0.001, help="GiB per GPU (default: this GPU's, else 80)."
    ),
    runtime_allowance: float | None = typer.Option(
        None,
        "--runtime-allowance",
        min=0.0,
        help="GiB kept for CUDA context, NCCL and fragmentation (default: 2 + 5% of memory).",
    ),
    overrides: list[str] = typer.Option(
        [], "--set", help="Override a recipe key: --set data.seq_len=2048 (value parsed as YAML)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead."),
) -> None:
    """Per-GPU memory of a recipe and the fewest checkpointed layers that fit."""
    from yatrain.config import load_recipe
    from yatrain.plan.memory import GIB, plan_memory

    loaded = load_recipe(recipe, overrides)
    limit, source = _memory_limit(gpu_memory, loaded)
    allowance = None if runtime_allowance is None else int(runtime_allowance * GIB)
    result = plan_memory(loaded, gpus, limit, allowance)
    if as_json:
        payload = {"recipe": str(recipe), "gpu_memory_source": source, **result.to_json()}
        typer.echo(json.dumps(payload))
    else:
        typer.echo(format_plan(result, loaded, recipe, source))


def sweep(
    recipe: Path = typer.Argument(..., help="Recipe YAML, e.g. recipes/tiny.yaml."),
    seq_len: str = typer.Option(..., "--seq-len", help="Comma-separated, e.g. 2048,4096,8192."),
    checkpoint_layers: str = typer.Option(
        "",
        "--activation-checkpoint-layers",
        help="Comma-separated, e.g. 0,auto (default: the recipe's setting).",
    ),  # fmt: skip
    steps: int = typer.Option(10, "--steps", min=1, help="Steps per configuration."),
    warmup: int = typer.Option(2, "--warmup", min=0, help="First steps left out of the figures."),
    output: Path | None = typer.Option(
        None,
        "--output",
        help="Sweep directory (default: runs/sweep-RECIPE-TIME); rerun with "
        "the same one to resume.",
    ),  # fmt: skip
    keep_batch_sequences: bool = typer.Option(
        False, "--keep-batch-sequences", help="Keep sequences per global batch, not tokens."
    ),
    nproc_per_node: int = typer.Option(
        1, "--nproc-per-node", min=1, help="Run each configuration under torchrun with N ranks."
    ),
    overrides: list[str] = typer.Option(
        [], "--set", help="Override a recipe key for every configuration (value parsed as YAML)."
    ),
) -> None:
    """Measure throughput and memory across sequence lengths and checkpoint settings."""
    from yatrain.plan import sweep as sw

    if steps <= warmup:
        raise ConfigError(f"--steps {steps} leaves nothing after --warmup {warmup}; raise --steps")
    seqs = []
    for item in sw.parse_list(seq_len, "--seq-len"):
        if not item.isdigit() or int(item) < 1:
            raise ConfigError(f"--seq-len: '{item}' is not a positive whole number")
        seqs.append(int(item))
    base, _ = sw.base_recipe(recipe, list(overrides))
    ckpts = (
        sw.parse_list(checkpoint_layers, "--activation-checkpoint-layers")
        if checkpoint_layers
        else [str(base.sharding.activation_checkpoint_layers)]
    )
    out_dir = output or sw.sweep_dir_name(recipe, time.strftime("%Y%m%d-%H%M%S"))
    recipe_path = recipe.resolve()
    configs = sw.expand_configs(
        recipe_path, list(overrides), seqs, ckpts, steps, nproc_per_node, keep_batch_sequences
    )
    typer.echo(f"sweep {out_dir}: {len(configs)} configurations x {steps} steps", err=True)
    rows = sw.run_sweep(
        recipe_path, configs, out_dir, nproc=nproc_per_node, warmup=warmup,
        echo=lambda line: typer.echo(line, err=True),
    )  # fmt: skip
    meta = {
        "recipe": str(recipe), "overrides": list(overrides), "steps": steps, "warmup": warmup,
        "nproc_per_node": nproc_per_node, "keep_batch_sequences": keep_batch_sequences,
    }  # fmt: skip
    csv_path, json_path = sw.write_tables(rows, out_dir, meta)
    plots = sw.draw_plots(rows, out_dir, recipe.stem, sw.memory_note(nproc_per_node))
    mode = sw.log_to_wandb(recipe_path, list(overrides), out_dir, rows, plots, meta)
    typer.echo(sw.format_table(rows))
    files = ", ".join(p.name for p in [csv_path, json_path, *plots])
    typer.echo(f"wrote {out_dir}: {files} | wandb {mode}", err=True)
