"""A sweep from the planner alone (``yatrain sweep --plan-only``): per sequence length and
context-parallel size, the checkpointed layers that fit, the per-GPU peak, the bytes each
GPU sends per step; nothing trains, so a laptop can sweep a cluster's job to 131,072 tokens.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from pathlib import Path

from yatrain.common import GIB, dumps_json
from yatrain.files import replacing, write_whole
from yatrain.plan import plan_memory
from yatrain.plan.layout import check_planned_layout
from yatrain.plan.limits import ASSUMED_GPU_GIB, local_device, memory_limit
from yatrain.recipe.load import load_recipe
from yatrain.sweep.configs import base_recipe, shape_overrides

PLAN_COLUMNS = [
    "name",
    "seq_len",
    "context_parallel",
    "global_batch_size",
    "micro_batch_size",
    "activation_checkpoint_layers",
    "fits",
    "peak_bytes_per_gpu",
    "tensor_peak_bytes",
    "recompute_flops_fraction",
    "bytes_per_step",
    "context_bytes_per_step",
    "min_context_parallel",
    "min_gpus",
]


def plan_rows(
    recipe_path: Path,
    seq_lens: Sequence[int],
    context_parallel: Sequence[int],
    gpus: int,
    gpu_memory_gib: float | None = None,
    overrides: Sequence[str] = (),
    keep_seqs: bool = False,
) -> tuple[list[dict], str]:
    """One planner row per (sequence length, CP size), and where the memory figure came
    from. Batches as a measured sweep's: the recipe's tokens per step unless ``keep_seqs``."""
    overrides = list(overrides)
    base, max_seq_len = base_recipe(recipe_path, overrides)
    limit, source = memory_limit(base, local_device(), gpu_memory_gib, ASSUMED_GPU_GIB)
    rows = []
    for seq in seq_lens:
        for cp in context_parallel:
            sets, gbs, micro = shape_overrides(
                base, max_seq_len, seq, cp, gpus, keep_seqs, overrides
            )
            recipe = load_recipe(recipe_path, sets)
            check_planned_layout(recipe, gpus, "--set sharding.shard_group_size=N")
            plan = plan_memory(recipe, gpus, limit)
            sent = plan.traffic["full"]
            rows.append(
                {
                    "name": f"seq{seq}-cp{cp}",
                    "seq_len": seq,
                    "context_parallel": cp,
                    "global_batch_size": gbs,
                    "micro_batch_size": micro,
                    "activation_checkpoint_layers": plan.activation_checkpoint_layers,
                    "fits": plan.fits,
                    "peak_bytes_per_gpu": plan.peak_bytes_per_gpu,
                    "tensor_peak_bytes": plan.tensor_peak_bytes,
                    "recompute_flops_fraction": plan.recompute_flops_fraction,
                    "bytes_per_step": sent["intra"] + sent["cross"],
                    "context_bytes_per_step": sent.get("context", 0),
                    "min_context_parallel": plan.min_context_parallel,
                    "min_gpus": plan.min_gpus,
                }
            )
    return rows, source


def format_plan_table(rows: list[dict], gpus: int, source: str) -> str:
    """The plan-only sweep as a markdown table (docs/sweep.md pastes it)."""
    lines = [
        f"planner only, {gpus} GPUs ({source}); peak per GPU with the runtime allowance",
        "",
        "| seq | CP | ckpt layers | peak GiB | fits | recompute | GiB sent/step (K/V) |",
        "|--:|--:|--:|--:|---|--:|--:|",
    ]
    for r in rows:
        fits = "yes" if r["fits"] else _short(r)
        sent = f"{r['bytes_per_step'] / GIB:,.1f} ({r['context_bytes_per_step'] / GIB:,.1f})"
        lines.append(
            f"| {r['seq_len']:,} | {r['context_parallel']} | {r['activation_checkpoint_layers']} "
            f"| {r['peak_bytes_per_gpu'] / GIB:.1f} | {fits} "
            f"| +{r['recompute_flops_fraction']:.0%} | {sent} |"
        )
    return "\n".join(lines)


def _short(row: dict) -> str:
    smallest = row["min_context_parallel"]
    if smallest:
        return (
            f"no: CP {smallest['context_parallel']} fits "
            f"({smallest['activation_checkpoint_layers']} ckpt)"
        )
    return "no"


def write_plan_tables(rows: list[dict], out_dir: Path, meta: dict) -> list[Path]:
    """``plan.csv`` and ``plan.json`` (the rows and how the sweep was asked)."""
    csv_path, json_path = out_dir / "plan.csv", out_dir / "plan.json"
    table = io.StringIO(newline="")
    writer = csv.DictWriter(table, fieldnames=PLAN_COLUMNS, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    write_whole(csv_path, table.getvalue())
    write_whole(json_path, dumps_json({**meta, "rows": rows}, indent=2) + "\n")
    return [csv_path, json_path]


def draw_plan_plots(rows: list[dict], out_dir: Path, title: str) -> Path:
    """``plan.png``: per-GPU peak, checkpointed layers and bytes sent per step against
    sequence length, one line per CP size (a hollow marker: does not fit)."""
    import matplotlib  # optional at import time: only a sweep that plots needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    panels = [
        ("peak_bytes_per_gpu", "peak per GPU (GiB)", GIB),
        ("activation_checkpoint_layers", "checkpointed layers", 1),
        ("bytes_per_step", "GiB sent per GPU per step", GIB),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(18, 4.4), dpi=100)
    for ax, (key, label, scale) in zip(axes, panels, strict=True):
        for i, cp in enumerate(dict.fromkeys(r["context_parallel"] for r in rows)):
            mine = sorted((r for r in rows if r["context_parallel"] == cp), key=_seq)
            ax.plot(
                [r["seq_len"] for r in mine], [r[key] / scale for r in mine], "-", color=f"C{i}"
            )
            for fits, face in ((True, f"C{i}"), (False, "none")):
                points = [r for r in mine if bool(r["fits"]) == fits]
                if not points:
                    continue
                ax.plot(
                    [r["seq_len"] for r in points],
                    [r[key] / scale for r in points],
                    "o",
                    color=f"C{i}",
                    markerfacecolor=face,
                    label=f"CP {cp}" + ("" if fits else ": does not fit"),
                )
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["seq_len"] for r in rows}))
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.set(xlabel="sequence length (tokens)", ylabel=label, title=f"{title}: {label}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = out_dir / "plan.png"
    with replacing(path) as file:
        fig.savefig(file, format="png")
    plt.close(fig)
    return path


def _seq(row: dict) -> int:
    return row["seq_len"]
