"""The ``yatrain`` command line: thin wrappers that turn flags into library calls.

User errors (``YatrainError``) become one line on stderr and exit code 2; ``--debug``
shows the traceback instead. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import typer

from yatrain.errors import ConfigError, Interrupted, YatrainError
from yatrain.plan.commands import PLAN_EXAMPLES, SWEEP_EXAMPLES, plan, sweep

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
) -> None:
    """Pretrain a recipe from scratch and log throughput, MFU and memory."""
    from yatrain.config import load_recipe
    from yatrain.train.loop import pretrain as run_pretrain

    loaded = load_recipe(recipe, overrides)
    run_pretrain(
        loaded,
        recipe_name=recipe.stem,
        run_dir=run_dir,
        steps=steps,
        resume=resume,
        progress=progress,
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
    from yatrain.data import prepare_data as run_prepare

    manifest = run_prepare(
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
) -> None:
    """Export a checkpoint's weights for other tools, one layer at a time."""
    from yatrain.train.weights import export_hf

    if format != "hf":
        raise ConfigError(f"--format {format}: the only export format is hf")
    if dtype not in (None, "fp32", "bf16"):
        raise ConfigError(f"--dtype {dtype}: choose fp32 or bf16")
    export_hf(checkpoint, output, dtype)
    typer.echo(f"wrote {output} (Hugging Face Llama, load with LlamaForCausalLM.from_pretrained)")


app.command("plan", epilog=PLAN_EXAMPLES)(plan)
app.command("sweep", epilog=SWEEP_EXAMPLES)(sweep)


def main() -> None:
    debug = "--debug" in sys.argv
    try:
        app(prog_name="yatrain")
    except Interrupted as stopped:
        print(f"yatrain: {stopped}", file=sys.stderr)
        sys.exit(130)
    except YatrainError as error:
        if debug:
            raise
        rank = os.environ.get("RANK")
        where = f" (rank {rank})" if rank is not None and os.environ.get("WORLD_SIZE") else ""
        print(f"yatrain: error{where}: {error}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("yatrain: interrupted", file=sys.stderr)
        sys.exit(130)
