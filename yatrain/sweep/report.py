"""A sweep's results as a console table, CSV and JSON files, and one W&B run."""

from __future__ import annotations

import csv
import io
from collections.abc import Callable
from pathlib import Path

import torch

from yatrain.common import GIB, dumps_json, format_bytes
from yatrain.files import write_whole
from yatrain.output.wandb_logger import WandbLogger
from yatrain.recipe.config import WandbConfig

COLUMNS = [
    "name",
    "seq_len",
    "context_parallel",
    "checkpoint",
    "activation_checkpoint_layers",
    "global_batch_size",
    "micro_batch_size",
    "status",
    "tokens_per_s_per_device",
    "tflops_per_device",
    "mfu",
    "step_time_s",
    "peak_tensor_bytes",
    "predicted_peak_bytes",
    "peak_memory_bytes",
    "measured_steps",
    "error",
]


def describe(row: dict) -> str:
    """One configuration's result in one line."""
    if row["status"] != "ok":
        return f"{row['status'].upper()}: {row['error']}"
    return (
        f"{row['tokens_per_s_per_device']:,.0f} tok/s/device, MFU {row['mfu']:.1%}, "
        f"tensor peak {format_bytes(row.get('peak_tensor_bytes'))} "
        f"(planned {format_bytes(row['predicted_peak_bytes'])}), "
        f"process peak {format_bytes(row['peak_memory_bytes'])}"
    )


def size_unit(rows: list[dict]) -> str:
    """GiB when any measured or planned peak reaches one, else MiB (tiny models on a CPU)."""
    keys = ("peak_tensor_bytes", "predicted_peak_bytes")  # what the memory plot shows
    sizes = [r.get(k) or 0 for r in rows for k in keys]
    return "GiB" if max(sizes, default=0) >= GIB else "MiB"


def format_table(rows: list[dict]) -> str:
    """A plain-text table, one row per configuration."""
    unit = size_unit(rows)
    head = [
        "config",
        "seq",
        "CP",
        "ckpt",
        "tok/s/dev",
        "TFLOP/s",
        "MFU",
        "step s",
        f"tensors {unit}",
        f"plan {unit}",
        f"process {unit}",
        "status",
    ]
    body = []
    for r in rows:
        ok = r["status"] == "ok"
        body.append(
            [
                r["name"],
                str(r["seq_len"]),
                str(r.get("context_parallel", 1)),
                f"{r['activation_checkpoint_layers']} ({r['checkpoint']})",
                f"{r['tokens_per_s_per_device']:,.0f}" if ok else "-",
                f"{r['tflops_per_device']:.3g}" if ok else "-",
                f"{r['mfu']:.1%}" if ok else "-",
                f"{r['step_time_s']:.3f}" if ok else "-",
                format_bytes(r.get("peak_tensor_bytes"), unit, suffix=False) if ok else "-",
                format_bytes(r["predicted_peak_bytes"], unit, suffix=False),
                format_bytes(r.get("peak_memory_bytes"), unit, suffix=False) if ok else "-",
                r["status"] if ok else r["status"].upper(),
            ]
        )
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=True)]
    lines = [
        " | ".join(x.ljust(w) for x, w in zip(line, widths, strict=True)) for line in [head, *body]
    ]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def write_tables(rows: list[dict], out_dir: Path, meta: dict) -> tuple[Path, Path]:
    """``sweep.csv`` and ``sweep.json`` (the rows plus how the sweep was run)."""
    table = io.StringIO(newline="")
    writer = csv.DictWriter(table, fieldnames=COLUMNS, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    csv_path = write_whole(out_dir / "sweep.csv", table.getvalue())
    json_path = write_whole(
        out_dir / "sweep.json", dumps_json({**meta, "rows": rows}, indent=2) + "\n"
    )
    return csv_path, json_path


def memory_note(nproc: int) -> str:
    """How to read measured against planned memory on this machine (like with like: live
    tensors both)."""
    ranks = f", per rank of {nproc}" if nproc > 1 else ""
    if torch.cuda.is_available():
        measured = "CUDA max_memory_allocated"
    else:
        measured = "live-tensor tracker on one warm-up step"
    return f"measured: tensor peak ({measured}{ranks}); planner: tensor peak, no allowance"


def log_to_wandb(
    wandb_cfg: WandbConfig,
    out_dir: Path,
    rows: list[dict],
    plots: list[Path],
    meta: dict,
    say: Callable[[str], None] = print,
) -> str:
    """The table and plots as one W&B run; returns the mode it ran in."""
    logger = WandbLogger(wandb_cfg, out_dir, meta, out_dir.name, say=say)
    if logger.run is None:
        return logger.mode
    import wandb  # optional at import time: only a sweep that logs needs it

    table = wandb.Table(columns=COLUMNS, data=[[r.get(c) for c in COLUMNS] for r in rows])
    images = {f"sweep/{p.stem}": wandb.Image(str(p)) for p in plots}
    results = out_dir / "results.jsonl"  # its length only grows: a resumed sweep continues
    step = len(results.read_text().splitlines()) if results.exists() else 0  # its W&B run
    logger.log({"sweep/results": table, **images}, step=step)
    logger.finish()
    return logger.mode
