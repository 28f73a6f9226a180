"""The charts of ``yatrain report``: one PNG per quantity over steps, every run on it.

Loss (held-out loss as dashed markers where the run evaluated), tokens/s per device, MFU,
peak memory, and the step-time breakdown (``timing``: one stacked panel per run, seconds
per step by part). Records that lack a field (a run from before it existed) leave it out.
"""

from __future__ import annotations

from pathlib import Path

from yatrain.common import GIB
from yatrain.files import replacing
from yatrain.output.console import BREAKDOWN
from yatrain.output.record import MetricsRecord

Runs = dict[str, list[MetricsRecord]]  # a run's label -> its records

# (file stem, title, y label, the value of a record or None)
LINES = [
    ("loss", "training loss", "loss", lambda r: r.loss),
    ("throughput", "throughput", "tokens/s per device", lambda r: r.tokens_per_s_per_device),
    ("mfu", "model FLOPs utilisation", "MFU (%)", lambda r: 100 * r.mfu),
    ("memory", "peak memory", "GiB", lambda r: _gib(r.peak_memory_bytes)),
]


def _gib(value: int | None) -> float | None:
    return value / GIB if value is not None else None


def draw_charts(runs: Runs, out_dir: Path) -> list[Path]:
    """Write the PNGs into ``out_dir``; returns their paths in display order."""
    import matplotlib  # imported where used: only a report draws

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {_plain(label): records for label, records in runs.items()}
    paths = []
    for stem, title, ylabel, value in LINES:
        fig, ax = plt.subplots(figsize=(7.2, 4.0), dpi=100)
        for i, (label, records) in enumerate(runs.items()):
            points = [(r.step, value(r)) for r in records if value(r) is not None]
            if points:
                ax.plot(*zip(*points, strict=True), "-", color=f"C{i}", label=label)
            if stem == "loss":
                held = [(r.step, r.val_loss) for r in records if r.val_loss is not None]
                if held:
                    ax.plot(
                        *zip(*held, strict=True),
                        "o--",
                        color=f"C{i}",
                        alpha=0.7,
                        label=f"{label}: held-out",
                    )
        _finish(ax, title, ylabel)
        paths.append(_save(plt, fig, out_dir / f"{stem}.png"))
    paths.append(_breakdown(plt, runs, out_dir / "step_time.png"))
    return paths


def _breakdown(plt, runs: Runs, path: Path) -> Path:
    """Seconds per step by part, stacked, one panel per run (shared axes)."""
    fig, axes = plt.subplots(
        len(runs), 1, figsize=(7.2, 2.8 * len(runs) + 0.6), dpi=100, sharex=True, squeeze=False
    )
    for ax, (label, records) in zip(axes[:, 0], runs.items(), strict=True):
        timed = [r for r in records if r.compute_s is not None]
        if timed:
            steps = [r.step for r in timed]
            parts = [[max(getattr(r, key), 0.0) for r in timed] for key in BREAKDOWN]
            ax.stackplot(steps, parts, labels=list(BREAKDOWN.values()), alpha=0.85)
        else:
            ax.text(
                0.5,
                0.5,
                "no step-time breakdown in these records",
                ha="center",
                transform=ax.transAxes,
            )
        _finish(ax, f"step time by part: {label}", "seconds per step")
    return _save(plt, fig, path)


def _finish(ax, title: str, ylabel: str) -> None:
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def _plain(label: str) -> str:
    """A run's name shown as typed: ``$`` would start matplotlib's math text."""
    return label.replace("$", r"\$")


def _save(plt, fig, path: Path) -> Path:
    """The figure as ``path``, written whole or not at all."""
    try:
        fig.tight_layout()
        with replacing(path) as file:
            fig.savefig(file, format="png")
    finally:
        plt.close(fig)
    return path
