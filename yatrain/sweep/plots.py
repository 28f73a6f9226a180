"""A sweep's plots: throughput and the tensor peak (measured and planned) against sequence
length. The measured line is live tensors, as the planner predicts, never the process's
resident memory."""

from __future__ import annotations

from pathlib import Path

from yatrain.common import GIB, MIB
from yatrain.files import replacing
from yatrain.sweep.report import size_unit


def series(row: dict) -> str:
    """A row's line in the plots: its checkpoint setting, and its CP size when not 1."""
    cp = row.get("context_parallel", 1)
    return f"checkpoint {row['checkpoint']}" + (f", CP {cp}" if cp != 1 else "")


def _panel(ax, kind: str, rows: list[dict], unit: str) -> None:
    """One plot against sequence length (log 2 axis), one colour per checkpoint setting
    (and CP size)."""
    from matplotlib.ticker import ScalarFormatter

    scale = GIB if unit == "GiB" else MIB
    for i, setting in enumerate(dict.fromkeys(series(r) for r in rows)):
        color, label = f"C{i}", setting
        mine = sorted((r for r in rows if series(r) == setting), key=lambda r: r["seq_len"])
        ok = [r for r in mine if r["status"] == "ok"]
        oom = [r for r in mine if r["status"] == "oom"]
        if kind == "throughput":
            ax.plot(
                [r["seq_len"] for r in ok],
                [r["tokens_per_s_per_device"] for r in ok],
                "o-",
                color=color,
                label=label,
            )
            continue
        seen = [r for r in ok if r.get("peak_tensor_bytes") is not None]  # like with like
        ax.plot(
            [r["seq_len"] for r in seen],
            [r["peak_tensor_bytes"] / scale for r in seen],
            "o-",
            color=color,
            label=f"{label}: measured",
        )
        ax.plot(
            [r["seq_len"] for r in mine],
            [r["predicted_peak_bytes"] / scale for r in mine],
            "s--",
            color=color,
            alpha=0.7,
            markersize=10,
            markerfacecolor="none",
            label=f"{label}: planner",
        )  # hollow: visible on a measured point
        if oom:
            ax.plot(
                [r["seq_len"] for r in oom],
                [r["predicted_peak_bytes"] / scale for r in oom],
                "x",
                color="red",
                markersize=10,
                label=f"{label}: OOM",
            )
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({r["seq_len"] for r in rows}))
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("tokens/s per device" if kind == "throughput" else f"tensor peak ({unit})")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)


def draw_plots(rows: list[dict], out_dir: Path, title: str, note: str = "") -> list[Path]:
    """``throughput.png`` and ``memory.png`` (measured solid, planner dashed with hollow
    squares, OOM as x), and
    both side by side in ``sweep.png``; ``note`` goes under the figures."""
    import matplotlib  # optional at import time: only a sweep that plots needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    unit = size_unit(rows)
    paths = []
    for name, kinds in (
        ("throughput", ["throughput"]),
        ("memory", ["memory"]),
        ("sweep", ["throughput", "memory"]),
    ):
        fig, axes = plt.subplots(1, len(kinds), figsize=(6.4 * len(kinds), 4.4), dpi=100)
        for ax, kind in zip(list(getattr(axes, "flat", [axes])), kinds, strict=True):
            _panel(ax, kind, rows, unit)
            ax.set_title(f"{title}: {kind}")
        if note:
            fig.text(0.01, 0.01, note, fontsize=7, alpha=0.8)
        fig.tight_layout(rect=(0, 0.04 if note else 0, 1, 1))
        paths.append(out_dir / f"{name}.png")
        with replacing(paths[-1]) as file:
            fig.savefig(file, format="png")
        plt.close(fig)
    return paths
