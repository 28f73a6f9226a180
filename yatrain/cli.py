"""The ``yatrain`` command line: thin wrappers that turn flags into library calls.

User errors (``YatrainError``) and a full or read-only disk (``OSError`` ENOSPC, EDQUOT,
EROFS, EACCES) become one line on stderr and exit code 2; ``--debug`` shows the traceback
instead. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import sys
from pathlib import Path

import typer

from yatrain.common import GIB
from yatrain.config import load_recipe
from yatrain.data import prepare_data as run_prepare_data
from yatrain.errors import ConfigError, Interrupted, YatrainError
from yatrain.plan import format_plan, memory_limit, plan_memory
from yatrain.plan.limits import ASSUMED_GPU_GIB, local_device
from yatrain.sweep import run_sweep
from yatrain.train.loop import pretrain as run_pretrain
from yatrain.train.setup import Checks
from yatrain.train.weights import export_hf

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Pretrain Llama-class models with a YaFSDP-style sharded data-parallel engine.",
)


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show full tracebacks for errors."),
) -> None:
    """yatrain: prepare data, then pretrain a recipe on one process or under torchrun."""


@app.command(
    epilog=(
        "Examples:\n\n"
        "  yatrain pretrain recipes/tiny.yaml\n\n"
        "  yatrain pretrain recipes/tiny.yaml --set model.n_layers=2 --steps 20\n\n"
        "  torchrun --nproc-per-node 8 -m yatrain pretrain recipes/llama3_8b.yaml"
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
    tensor_peak_step: int | None = typer.Option(
        None,
        "--tensor-peak-step",
        min=1,
        help="On CPU, count live tensors during this step (slower) and log peak_tensor_bytes.",
    ),
) -> None:
    """Pretrain a recipe from scratch and log throughput, MFU and memory."""
    loaded = load_recipe(recipe, overrides)
    run_pretrain(
        loaded,
        recipe_name=recipe.stem,
        run_dir=run_dir,
        steps=steps,
        resume=resume,
        progress=progress,
        checks=Checks(fit=fit_check, verify=verify, tensor_step=tensor_peak_step),
    )


@app.command(
    "prepare-data",
    epilog=(
        "Examples:\n\n"
        "  yatrain prepare-data --output data/stdlib --vocab-size 4096\n\n"
        "  yatrain prepare-data --output data/mine --input corpus.jsonl.zst --input books/ "
        "--tokenizer llama2/tokenizer.model\n\n"
        "  yatrain prepare-data --output data/web --input shards/ --text-field content "
        "--tokenizer Meta-Llama-3-8B/original/tokenizer.model"
    ),
)
def prepare_data(
    output: Path = typer.Option(..., "--output", help="New directory for the tokenized data."),
    inputs: list[Path] = typer.Option(
        [],
        "--input",
        help="Text, JSONL or parquet file (optionally .gz/.zst) or a directory of them, "
        "repeatable (default: the stdlib corpus).",
    ),
    tokenizer: Path | None = typer.Option(
        None,
        "--tokenizer",
        help="Tokenizer to encode with: a sentencepiece model (Llama 2), Llama 3's tiktoken "
        "tokenizer.model, or a Hugging Face tokenizer.json or model directory.",
    ),
    vocab_size: int | None = typer.Option(
        None, "--vocab-size", min=2, help="Train a new BPE tokenizer of this size instead."
    ),
    text_field: str = typer.Option(
        "text", "--text-field", help="JSONL field / parquet column holding the text."
    ),
    skip_bad_records: bool = typer.Option(
        False,
        "--skip-bad-records",
        help="Skip and count unreadable records instead of stopping at the first one.",
    ),
    workers: int | None = typer.Option(
        None, "--workers", min=1, help="Tokenizer processes (default: one per core)."
    ),
    bos_token: str | None = typer.Option(
        None, "--bos-token", help="tokenizer.json only: the token (or id) that starts documents."
    ),
    eos_token: str | None = typer.Option(
        None, "--eos-token", help="tokenizer.json only: the token (or id) that ends documents."
    ),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show a progress bar."),
) -> None:
    """Tokenize documents into checksummed shards (the default corpus needs no download)."""
    manifest = run_prepare_data(
        output,
        inputs or None,
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        progress=progress,
        text_field=text_field,
        skip_bad_records=skip_bad_records,
        workers=workers,
        bos_token=bos_token,
        eos_token=eos_token,
    )
    skipped = manifest["skipped_bad_records"]
    typer.echo(
        f"wrote {output}: {manifest['num_tokens']:,} tokens, {manifest['num_documents']:,} "
        f"documents, {manifest['tokenizer_kind']} tokenizer with vocab {manifest['vocab_size']}"
        + (f", {skipped:,} bad records skipped" if skipped else "")
    )


@app.command(
    epilog=(
        "Examples:\n\n"
        "  yatrain export runs/tiny-20261202-101500/checkpoints/step-60 --output hf/tiny\n\n"
        "  yatrain export CHECKPOINT --format hf --dtype bf16 --output hf/model"
    )
)
def export(
    checkpoint: Path = typer.Argument(..., help="A checkpoint directory (RUN/checkpoints/step-N)."),
    output: Path = typer.Option(..., "--output", help="New directory to write."),
    format: str = typer.Option("hf", "--format", help="hf: a Hugging Face LlamaForCausalLM."),
    dtype: str | None = typer.Option(
        None, "--dtype", help="fp32 or bf16 (default: the training dtype)."
    ),
    verify: bool = typer.Option(
        True, "--verify/--no-verify", help="Check the checkpoint's checksums first."
    ),
) -> None:
    """Export a checkpoint's weights for other tools, one layer at a time."""
    if format != "hf":
        raise ConfigError(f"--format {format}: the only export format is hf")
    if dtype not in (None, "fp32", "bf16"):
        raise ConfigError(f"--dtype {dtype}: choose fp32 or bf16")
    signal.signal(signal.SIGTERM, _interrupt)  # a killed export removes its partial output
    export_hf(checkpoint, output, dtype, verify=verify)
    typer.echo(f"wrote {output} (Hugging Face Llama, load with LlamaForCausalLM.from_pretrained)")


@app.command(
    epilog=(
        "Examples:\n\n"
        "  yatrain plan recipes/llama3_70b.yaml --gpus 256 --set data.seq_len=2048\n\n"
        "  yatrain plan recipes/llama3_8b.yaml --gpus 8 --gpu-memory 80 --json"
    )
)
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
    loaded = load_recipe(recipe, overrides)
    limit, source = memory_limit(loaded, local_device(), gpu_memory, ASSUMED_GPU_GIB)
    allowance = None if runtime_allowance is None else int(runtime_allowance * GIB)
    result = plan_memory(loaded, gpus, limit, allowance)
    if as_json:
        payload = {"recipe": str(recipe), "gpu_memory_source": source, **result.to_json()}
        typer.echo(json.dumps(payload))
    else:
        typer.echo(format_plan(result, loaded, recipe, source))


def _comma_list(text: str, flag: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise ConfigError(f"{flag}: give a comma-separated list, e.g. 2048,4096")
    return items


def _lengths(text: str) -> list[int]:
    items = _comma_list(text, "--seq-len")
    for item in items:
        if not item.isdigit() or int(item) < 1:
            raise ConfigError(f"--seq-len: '{item}' is not a positive whole number")
    return [int(item) for item in items]


@app.command(
    epilog=(
        "Examples:\n\n"
        "  yatrain sweep recipes/tiny.yaml --seq-len 64,128,256 "
        "--activation-checkpoint-layers 0,4\n\n"
        "  yatrain sweep recipes/llama3_8b.yaml --seq-len 2048,4096,8192 "
        "--activation-checkpoint-layers 0,auto --nproc-per-node 8 --output runs/sweep-8b"
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
    output: Path | None = typer.Option(
        None,
        "--output",
        help="Sweep directory (default: runs/sweep-RECIPE-TIME); rerun with the same one to "
        "resume.",
    ),
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
    lengths = _lengths(seq_len)
    settings = (
        _comma_list(checkpoint_layers, "--activation-checkpoint-layers")
        if checkpoint_layers
        else []
    )
    result = run_sweep(
        recipe, lengths, settings, steps=steps, warmup=warmup,
        output=output, keep_batch_sequences=keep_batch_sequences,
        nproc_per_node=nproc_per_node, overrides=overrides,
        echo=lambda line: typer.echo(line, err=True),
    )  # fmt: skip
    typer.echo(result.table)
    files = ", ".join(p.name for p in result.files)
    typer.echo(f"wrote {result.out_dir}: {files} | wandb {result.wandb_mode}", err=True)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


# What the machine's file system can refuse (not a bug): full, over quota, read-only, denied.
_DISK_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}


def main() -> None:
    debug = "--debug" in sys.argv
    try:
        app(prog_name="yatrain")
    except Interrupted as stopped:
        print(f"yatrain: {stopped}", file=sys.stderr)
        sys.exit(130)
    except (YatrainError, OSError) as error:
        if debug or (isinstance(error, OSError) and error.errno not in _DISK_ERRORS):
            raise
        rank = os.environ.get("RANK")
        where = f" (rank {rank})" if rank is not None and os.environ.get("WORLD_SIZE") else ""
        print(f"yatrain: error{where}: {_one_line(error)}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("yatrain: interrupted", file=sys.stderr)
        sys.exit(130)


def _one_line(error: BaseException) -> str:
    if isinstance(error, OSError):
        where = f": {error.filename}" if error.filename else ""
        return f"{error.strerror or error}{where}; free space or fix permissions, then rerun"
    return str(error)
