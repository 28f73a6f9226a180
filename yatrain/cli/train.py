"""Training commands: ``yatrain pretrain``, ``plan``, ``sweep`` and ``report``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from yatrain.cli.app import app
from yatrain.cli.launch_options import (
    MAX_RESTARTS,
    NNODES,
    NPROC_PER_NODE,
    OVERSUBSCRIBE,
    RDZV_ENDPOINT,
    RDZV_ID,
    RDZV_TIMEOUT,
    check_launch,
)
from yatrain.cli.plan_dry_run import DRY_RANK, DRY_RUN, DRY_STEPS, print_dry_run
from yatrain.cli.sweep_options import (
    MAX_GIB,
    MAX_GPUS,
    MIN_GPU_GIB,
    SWEEP_CP,
    SWEEP_GPU_MEMORY,
    SWEEP_GPUS,
    SWEEP_KEEP_BATCH,
    SWEEP_OUTPUT,
    SWEEP_PLAN_ONLY,
    comma_list,
    gib_flag,
    is_whole_number,
    lengths_of,
    plan_only_sweep,
)
from yatrain.errors import ConfigError

if TYPE_CHECKING:
    pass

# The library (torch and all) is imported inside each command, so that --help, a mistyped
# command or a bad flag answer at once (tests/integration/test_cli_start.py).

PLAN_CP = typer.Option(
    None,
    "--context-parallel",
    min=1,
    help="Cut each window over N GPUs (sharding.context_parallel).",
)


RESET_OPTIMIZER = typer.Option(
    False,
    "--reset-optimizer",
    help="Resume a checkpoint written with another optim.name: its weights and data "
    "position, this optimizer's state started afresh (else refused).",
)


@app.command(
    epilog=(
        "Examples:\n\n"
        "  yatrain pretrain recipes/tiny.yaml\n\n"
        "  yatrain pretrain recipes/tiny.yaml --set model.n_layers=2 --steps 20\n\n"
        "  yatrain pretrain recipes/llama3_8b.yaml --nproc-per-node 8\n\n"
        "  yatrain pretrain recipes/llama3_70b.yaml --nproc-per-node 8 --nnodes 4 "
        "--rdzv-endpoint HOST:29500 --rdzv-id JOB"
    )
)
def pretrain(
    recipe: Path = typer.Argument(..., help="Recipe YAML, e.g. recipes/tiny.yaml."),
    overrides: list[str] = typer.Option(
        [], "--set", help="Override a recipe key: --set model.n_layers=2 (value parsed as YAML)."
    ),
    run_dir: Path | None = typer.Option(
        None, "--run-dir", help="Where config.yaml and metrics.jsonl go (default: runs/NAME-TIME)."
    ),
    steps: int | None = typer.Option(None, "--steps", min=1, help="Override train.steps."),
    resume: str = typer.Option(
        "auto",
        "--resume",
        help="auto: continue from the newest good checkpoint in the run dir, if any; "
        "never: refuse to reuse a run dir; PATH: that checkpoint directory.",
    ),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show a progress bar."),
    fit_check: bool = typer.Option(
        True,
        "--fit-check/--no-fit-check",
        help="Refuse a run the memory planner says will not fit this device (default on).",
    ),
    verify: bool = typer.Option(
        True, "--verify/--no-verify", help="Check checkpoint checksums before loading one."
    ),
    reset_optimizer: bool = RESET_OPTIMIZER,
    tensor_peak_step: int | None = typer.Option(
        None,
        "--tensor-peak-step",
        min=1,
        help="On CPU, count live tensors during this step (slower) and log peak_tensor_bytes.",
    ),
    nproc_per_node: int | None = NPROC_PER_NODE,
    nnodes: str = NNODES,
    rdzv_endpoint: str | None = RDZV_ENDPOINT,
    rdzv_id: str | None = RDZV_ID,
    max_restarts: int = MAX_RESTARTS,
    rdzv_timeout: int = RDZV_TIMEOUT,
    oversubscribe: bool = OVERSUBSCRIBE,
) -> None:
    """Pretrain a recipe from scratch and log throughput, MFU and memory."""
    from yatrain.recipe.load import load_recipe
    from yatrain.runtime.launch import Launch, launch
    from yatrain.train.loop import pretrain as run_pretrain
    from yatrain.train.setup import Checks

    if nproc_per_node is not None:  # the launcher: the ranks run this command without it
        rdzv = (rdzv_endpoint, rdzv_id, max_restarts, rdzv_timeout)
        job = Launch(nproc_per_node, nnodes, *rdzv, oversubscribe)
        check_launch(job, recipe, overrides)
        raise typer.Exit(launch(job, sys.argv[1:]))
    loaded = load_recipe(recipe, overrides)
    run_pretrain(
        loaded,
        recipe_name=recipe.stem,
        run_dir=run_dir,
        steps=steps,
        resume=resume,
        progress=progress,
        checks=Checks(fit_check, verify, tensor_peak_step, reset_optimizer),
    )


@app.command(
    epilog=(
        "Examples:\n\n"
        "  yatrain plan recipes/llama3_70b.yaml --gpus 256 --set data.seq_len=2048\n\n"
        "  yatrain plan recipes/llama3_70b.yaml --gpus 256 --shard-group-size 8\n\n"
        "  yatrain plan recipes/llama3_8b.yaml --gpus 8 --gpu-memory 80 --json\n\n"
        "  yatrain plan recipes/llama3_1_8b.yaml --gpus 8 --context-parallel 8 "
        "--set data.seq_len=131072"
    )
)
def plan(
    recipe: Path = typer.Argument(..., help="Recipe YAML, e.g. recipes/llama3_8b.yaml."),
    gpus: int = typer.Option(
        ..., "--gpus", min=1, max=MAX_GPUS, help="Number of GPUs (data-parallel ranks)."
    ),
    gpu_memory: float | None = typer.Option(
        None,
        "--gpu-memory",
        callback=lambda value: gib_flag(value, MIN_GPU_GIB),
        help=f"GiB per GPU (default: this GPU's, else 80), at most {MAX_GIB}.",
    ),
    runtime_allowance: float | None = typer.Option(
        None,
        "--runtime-allowance",
        callback=lambda value: gib_flag(value, 0.0),
        help="GiB kept for CUDA context, NCCL and fragmentation (default: 2 + 5% of memory).",
    ),
    overrides: list[str] = typer.Option(
        [], "--set", help="Override a recipe key: --set data.seq_len=2048 (value parsed as YAML)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead."),
    shard_group_size: str | None = typer.Option(
        None,
        "--shard-group-size",
        help="Hybrid sharding: shard within groups of N GPUs (GPUs per node), replicate across.",
    ),
    context_parallel: int | None = PLAN_CP,
    dry_run: bool = DRY_RUN,
    rank: int = DRY_RANK,
    steps: int = DRY_STEPS,
) -> None:
    """Per-GPU memory of a recipe, the fewest checkpointed layers that fit, and the bytes
    each GPU sends per step (full against hybrid sharding). A sequence that fits no GPU
    count is named the smallest context-parallel size that fits."""
    from yatrain.common import GIB, dumps_json
    from yatrain.plan import format_plan, memory_limit, plan_memory
    from yatrain.plan.layout import check_planned_layout
    from yatrain.plan.limits import ASSUMED_GPU_GIB, local_device
    from yatrain.recipe.load import load_recipe

    overrides = _plan_overrides(overrides, context_parallel, shard_group_size)
    loaded = load_recipe(recipe, overrides)
    check_planned_layout(loaded, gpus, "--shard-group-size N")
    limit, source = memory_limit(loaded, local_device(), gpu_memory, ASSUMED_GPU_GIB)
    allowance = None if runtime_allowance is None else int(runtime_allowance * GIB)
    if dry_run:  # the real engine and loop on a fake world: docs/planner.md#dry-run
        return print_dry_run(recipe, loaded, gpus, limit, allowance, rank, steps, as_json)
    result = plan_memory(loaded, gpus, limit, allowance)
    if as_json:
        payload = {"recipe": str(recipe), "gpu_memory_source": source, **result.to_json()}
        typer.echo(dumps_json(payload))
    else:
        typer.echo(format_plan(result, loaded, recipe, source))


def _plan_overrides(
    overrides: list[str], context_parallel: int | None, shard_group_size: str | None
) -> list[str]:
    """The recipe overrides ``--context-parallel`` and ``--shard-group-size`` stand for."""
    if context_parallel is not None:
        overrides = [*overrides, f"sharding.context_parallel={context_parallel}"]
    if shard_group_size is not None:
        if not is_whole_number(shard_group_size) and shard_group_size != "auto":
            raise ConfigError(f"--shard-group-size {shard_group_size}: pass a number of GPUs")
        overrides = [*overrides, f"sharding.shard_group_size={shard_group_size}"]
    return overrides


@app.command(
    epilog=(
        "Examples:\n\n"
        "  yatrain sweep recipes/tiny.yaml --seq-len 64,128,256 "
        "--activation-checkpoint-layers 0,4\n\n"
        "  yatrain sweep recipes/llama3_8b.yaml --seq-len 2048,4096,8192 "
        "--activation-checkpoint-layers 0,auto --nproc-per-node 8 --output runs/sweep-8b\n\n"
        "  yatrain sweep recipes/llama3_1_8b.yaml --plan-only --gpus 8 "
        "--seq-len 8192,32768,131072 --context-parallel 1,2,4,8"
    )
)
def sweep(
    recipe: Path = typer.Argument(..., help="Recipe YAML, e.g. recipes/tiny.yaml."),
    seq_len: str = typer.Option(..., "--seq-len", help="Comma-separated, e.g. 2048,4096,8192."),
    checkpoint_layers: str = typer.Option(
        "",
        "--activation-checkpoint-layers",
        help="Comma-separated, e.g. 0,auto (default: the recipe's setting).",
    ),
    steps: int = typer.Option(10, "--steps", min=1, help="Steps per configuration."),
    warmup: int = typer.Option(2, "--warmup", min=0, help="First steps left out of the figures."),
    output: Path | None = SWEEP_OUTPUT,
    keep_batch_sequences: bool = SWEEP_KEEP_BATCH,
    nproc_per_node: int = typer.Option(
        1, "--nproc-per-node", min=1, help="Run each configuration under torchrun with N ranks."
    ),
    overrides: list[str] = typer.Option(
        [], "--set", help="Override a recipe key for every configuration (value parsed as YAML)."
    ),
    context_parallel: str = SWEEP_CP,
    plan_only: bool = SWEEP_PLAN_ONLY,
    gpus: int | None = SWEEP_GPUS,
    gpu_memory: float | None = SWEEP_GPU_MEMORY,
) -> None:
    """Measure throughput and memory across sequence lengths, checkpoint settings and CP
    sizes; or, with --plan-only, tabulate the planner's figures without training."""
    from yatrain.sweep import run_sweep

    lengths = lengths_of(seq_len)
    sizes = lengths_of(context_parallel, "--context-parallel") if context_parallel else []
    if plan_only:
        plan_args = (gpus or nproc_per_node, gpu_memory, output, keep_batch_sequences)
        plan_only_sweep(recipe, lengths, sizes, *plan_args, overrides)
        return
    if gpus is not None or gpu_memory is not None:
        raise ConfigError("--gpus and --gpu-memory plan a sweep: pass --plan-only with them")
    settings = (
        comma_list(checkpoint_layers, "--activation-checkpoint-layers") if checkpoint_layers else []
    )
    result = run_sweep(
        recipe,
        lengths,
        settings,
        steps=steps,
        warmup=warmup,
        output=output,
        keep_batch_sequences=keep_batch_sequences,
        nproc_per_node=nproc_per_node,
        overrides=overrides,
        echo=lambda line: typer.echo(line, err=True),
        context_parallel=sizes,
    )
    typer.echo(result.table)
    files = ", ".join(p.name for p in result.files)
    typer.echo(f"wrote {result.out_dir}: {files} | wandb {result.wandb_mode}", err=True)


@app.command(
    epilog=(
        "Examples:\n\n"
        "  yatrain report runs/tiny-20261203-101500\n\n"
        "  yatrain report runs/a runs/b --output reports/a-vs-b"
    )
)
def report(
    run_dirs: list[Path] = typer.Argument(..., help="Run directories (one or several)."),
    output: Path | None = typer.Option(
        None,
        "--output",
        help="Where the PNGs and report.html go (default: RUN_DIR/report for one run, "
        "./report for several); a new or empty directory, or an earlier report's.",
    ),
) -> None:
    """Chart one run, or several side by side: PNGs and one self-contained HTML file."""
    from yatrain.output.html_report import write_report

    out_dir = output or (run_dirs[0] / "report" if len(run_dirs) == 1 else Path("report"))
    path = write_report(run_dirs, out_dir)
    typer.echo(f"wrote {path} (open it in a browser; no network needed) and its PNGs", err=True)
