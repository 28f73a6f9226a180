"""``yatrain prepare-data``: documents in, a tokenized data directory out."""

from __future__ import annotations

import signal
from pathlib import Path

import typer

from yatrain.cli.app import app, interrupt
from yatrain.data.split import DEFAULT_VAL_FRACTION
from yatrain.errors import DataError

_INPUTS = typer.Option(
    [],
    "--input",
    help="Text, JSONL or parquet file (optionally .gz/.zst) or a directory of them, "
    "repeatable (default: the stdlib corpus).",
)
_TOKENIZER = typer.Option(
    None,
    "--tokenizer",
    help="Tokenizer to encode with: a sentencepiece model (Llama 2), Llama 3's tiktoken "
    "tokenizer.model, or a Hugging Face tokenizer.json or model directory.",
)
_SKIP_BAD_RECORDS = typer.Option(
    False,
    "--skip-bad-records",
    help="Skip and count unreadable records instead of stopping at the first one.",
)
_SHARD = typer.Option(
    None,
    "--shard",
    help="I/N: tokenize only part I (0-based) of N into OUTPUT/parts, one task of a "
    "cluster job (needs --tokenizer); then --merge OUTPUT. N is at most 99999 (part "
    "folders are numbered in 5 digits); OUTPUT holds nothing but what prepare-data writes.",
)
_MERGE = typer.Option(
    None, "--merge", help="Check the N parts under DIR/parts and write DIR's manifest."
)


@app.command(
    "prepare-data",
    epilog=(
        "Examples:\n\n"
        "  yatrain prepare-data --output data/stdlib --vocab-size 4096\n\n"
        "  yatrain prepare-data --output data/mine --input corpus.jsonl.zst --input books/ "
        "--tokenizer llama2/tokenizer.model\n\n"
        "  yatrain prepare-data --output data/web --input shards/ --text-field content "
        "--tokenizer Meta-Llama-3-8B/original/tokenizer.model\n\n"
        "  yatrain prepare-data --output /shared/web --input /shared/raw/ --tokenizer "
        "tokenizer.model --shard $SLURM_ARRAY_TASK_ID/64   (then: --merge /shared/web)"
    ),
)
def prepare_data(
    output: Path | None = typer.Option(
        None,
        "--output",
        help="New directory for the tokenized data, outside every --input directory.",
    ),
    inputs: list[Path] = _INPUTS,
    tokenizer: Path | None = _TOKENIZER,
    vocab_size: int | None = typer.Option(
        None, "--vocab-size", min=2, help="Train a new BPE tokenizer of this size instead."
    ),
    text_field: str = typer.Option(
        "text", "--text-field", help="JSONL field / parquet column holding the text."
    ),
    skip_bad_records: bool = _SKIP_BAD_RECORDS,
    workers: int | None = typer.Option(
        None, "--workers", help="Tokenizer processes, at most one per core (default: one per core)."
    ),
    bos_token: str | None = typer.Option(
        None, "--bos-token", help="tokenizer.json only: the token (or id) that starts documents."
    ),
    eos_token: str | None = typer.Option(
        None, "--eos-token", help="tokenizer.json only: the token (or id) that ends documents."
    ),
    val_fraction: float = typer.Option(
        DEFAULT_VAL_FRACTION, "--val-fraction", help="Share of documents held out for validation."
    ),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show a progress bar."),
    shard: str | None = _SHARD,
    merge: Path | None = _MERGE,
) -> None:
    """Tokenize documents into checksummed shards (the default corpus needs no download)."""
    signal.signal(signal.SIGTERM, interrupt)  # a killed run ends its workers, leaves nothing
    if merge is not None:
        _merge(merge, output is not None or shard is not None or bool(inputs) or bool(tokenizer))
        return
    if output is None:
        raise DataError("pass --output DIR (the new data directory), or --merge DIR")
    common = dict(
        progress=progress,
        text_field=text_field,
        skip_bad_records=skip_bad_records,
        workers=workers,
        bos_token=bos_token,
        eos_token=eos_token,
        val_fraction=val_fraction,
    )
    if shard is not None:
        _part(output, inputs, tokenizer if vocab_size is None else None, shard, common)
        return
    from yatrain.data.prepare import prepare_data as run_prepare_data  # torch: when run

    manifest = run_prepare_data(
        output, inputs or None, tokenizer=tokenizer, vocab_size=vocab_size, **common
    )
    typer.echo(f"wrote {output}: {_summary(manifest)}")


def _merge(folder: Path, other_options: bool) -> None:
    from yatrain.data.merge import merge_parts

    if other_options:
        raise DataError(
            "--merge DIR takes no --output, --shard, --input or tokenizer: it checks and "
            "joins the parts under DIR/parts, made with those options"
        )
    typer.echo(f"merged {folder}: {_summary(merge_parts(folder))}")


def _part(output: Path, inputs: list[Path], tokenizer: Path | None, shard: str, common: dict):
    from yatrain.data.parts import parse_shard, prepare_part

    index, count = parse_shard(shard)
    if tokenizer is None:
        raise DataError(
            "--shard needs an existing --tokenizer: training one (--vocab-size) reads every "
            "input, so train it with a one-machine prepare-data first and pass its "
            "tokenizer.model"
        )
    manifest = prepare_part(output, inputs or None, tokenizer, (index, count), **common)
    typer.echo(f"wrote part {index}/{count} of {output}: {_summary(manifest)}")


def _count(number: int, thing: str) -> str:
    """``1 document``, ``2 documents``."""
    return f"{number:,} {thing}{'' if number == 1 else 's'}"


def _summary(manifest: dict) -> str:
    skipped, val = manifest["skipped_bad_records"], manifest["validation"]
    return (
        f"{_count(manifest['num_tokens'], 'token')}, "
        f"{_count(manifest['num_documents'], 'document')}"
        + (
            f" (+ {_count(val['num_tokens'], 'token')}, "
            f"{_count(val['num_documents'], 'document')} held out)"
            if val
            else ", no validation split"
        )
        + f", {manifest['tokenizer_kind']} tokenizer with vocab {manifest['vocab_size']}"
        + (f", {_count(skipped, 'bad record')} skipped" if skipped else "")  # pinned by test_inputs
        + (
            f", {_count(empty, 'empty document')} dropped"
            if (empty := manifest["empty_documents"])
            else ""
        )
    )
