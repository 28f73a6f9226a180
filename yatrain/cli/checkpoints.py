"""What to do with a checkpoint: ``yatrain export``, ``eval`` and ``generate``."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import typer

from yatrain.cli.app import app, interrupt
from yatrain.errors import ConfigError

# The library (torch and all) is imported inside each command: --help answers at once.


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
        None,
        "--dtype",
        help="fp32 or bf16 (default: bf16 above 1B parameters, else the training dtype).",
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
    from yatrain.checkpoint.hf_export import export_hf

    signal.signal(signal.SIGTERM, interrupt)  # a killed export removes its partial output
    export_hf(checkpoint, output, dtype, verify=verify)
    typer.echo(f"wrote {output} (Hugging Face Llama, load with LlamaForCausalLM.from_pretrained)")


def _main_rank() -> bool:
    return os.environ.get("RANK", "0") == "0"


@app.command(
    "eval",
    epilog=(
        "Examples:\n\n"
        "  yatrain eval runs/tiny-20261202-101500/checkpoints/step-120\n\n"
        "  torchrun --nproc-per-node 8 -m yatrain eval CHECKPOINT --data data/other --json"
    ),
)
def evaluate(
    checkpoint: Path = typer.Argument(..., help="A checkpoint directory (RUN/checkpoints/step-N)."),
    data: Path | None = typer.Option(
        None,
        "--data",
        help="Data dir: its validation split, or all of it if it has none "
        "(default: the held-out data of the checkpoint's recipe).",
    ),
    batches: int | None = typer.Option(
        None, "--batches", min=1, help="Global batches of windows (default: eval.batches)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead."),
) -> None:
    """Held-out loss of a checkpoint, as its run logged it (one process or torchrun)."""
    from yatrain.common import dumps_json
    from yatrain.inference.evaluate_checkpoint import evaluate_checkpoint

    result = evaluate_checkpoint(
        checkpoint, data=data, batches=batches, say=lambda line: typer.echo(line, err=True)
    )
    if not _main_rank():
        return
    if as_json:
        typer.echo(dumps_json(result))
        return
    sources = "".join(f" | {k} {v:.4f}" for k, v in result.items() if k.startswith("val_loss/"))
    ppl = "inf" if result["val_ppl"] is None else f"{result['val_ppl']:.2f}"
    typer.echo(
        f"step {result['step']} | val_loss {result['val_loss']:.4f} | val_ppl {ppl}{sources} | "
        f"{result['val_tokens']:,} tokens ({result['val_windows']:,} windows of "
        f"{result['seq_len']}+1) in {result['seconds']:.1f}s"
    )


@app.command(
    epilog=(
        "Examples:\n\n"
        "  yatrain generate runs/tiny-20261202-101500/checkpoints/step-120 --prompt 'def '\n\n"
        "  yatrain generate CHECKPOINT --prompt 'import os' --temperature 0 --json"
    )
)
def generate(
    checkpoint: Path = typer.Argument(..., help="A checkpoint directory (RUN/checkpoints/step-N)."),
    prompt: str = typer.Option(..., "--prompt", help="Text to continue (BOS is put first)."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", min=1, help="Stop after N."),
    temperature: float = typer.Option(0.8, "--temperature", min=0.0, help="0 = greedy."),
    top_k: int | None = typer.Option(None, "--top-k", min=1, help="Sample from the k likeliest."),
    top_p: float = typer.Option(
        1.0,
        "--top-p",
        help="Sample from the likeliest tokens whose probabilities add up to p (nucleus).",
    ),
    seed: int = typer.Option(
        0, "--seed", min=0, max=2**64 - 1, help="Seed of the sampling generator (0 to 2^64-1)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead."),
) -> None:
    """Continue a prompt with a checkpoint (one process: the CPU or one GPU, KV cache)."""
    from yatrain.common import dumps_json
    from yatrain.inference.generate_text import generate_text
    from yatrain.models.generate import Sampling

    sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p)
    result = generate_text(
        checkpoint, prompt, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed
    )
    typer.echo(dumps_json(result) if as_json else prompt + result["text"])
