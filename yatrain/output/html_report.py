"""``yatrain report RUN_DIR [RUN_DIR...]``: a run (or several, side by side) as PNGs and one
self-contained HTML page.

It reads each run's ``metrics.jsonl`` (a run still in progress works: a line being written
is left out), draws the charts (``charts``) and writes ``report.html`` with the images
inside it as data URIs, a table per run (the summary the console prints at the end, plus
the step-time breakdown and the slowest rank) and, where a run stopped on a hang, its hang
report: a file that opens with no network and no other file beside it.

A report replaces only its own files: the output directory must be new, empty, or one
that a report made (``.yatrain-report`` lists the files it wrote there). One that holds
anything else, or that is a symbolic link, is refused in one line before anything is read
or written; each file goes in by rename, so a link inside is replaced, never followed.
"""

from __future__ import annotations

import base64
import html
import os
import shutil
from pathlib import Path

from yatrain.errors import ConfigError
from yatrain.files import make_directory, no_follow, write_whole
from yatrain.output.charts import LINES, Runs, draw_charts
from yatrain.output.console import BREAKDOWN, format_summary, run_summary
from yatrain.output.record import MetricsRecord, read_metrics
from yatrain.runtime.hang import hang_dir

MARKER = ".yatrain-report"  # the files a report wrote in its directory, one a line
_HEADER = "# written by yatrain report: the next report here replaces these files\n"
PAGE = "report.html"
OWN = [*(f"{stem}.png" for stem, *_ in LINES), "step_time.png", PAGE]  # what a report writes


def read_run(run_dir: Path) -> list[MetricsRecord]:
    """The records of ``run_dir`` so far; a last line still being written is left out."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(
            f"{run_dir} has no metrics.jsonl: pass a run directory that a "
            "`yatrain pretrain` has logged at least one step into"
        )
    records = read_metrics(path)
    if not records:
        raise ConfigError(f"{path} holds no record yet: wait for the run's first logged step")
    return records


def write_report(run_dirs: list[Path], out_dir: Path) -> Path:
    """The PNGs and ``report.html`` in ``out_dir``, each written whole; returns the HTML
    file's path. A report that fails leaves no directory it created; one into a directory
    holding files it did not write is refused first (ConfigError)."""
    earlier = _own_files(out_dir)
    labels = _labels(run_dirs)
    runs: Runs = {label: read_run(d) for label, d in zip(labels, run_dirs, strict=True)}
    created = make_directory(out_dir, "--output")
    try:
        write_whole(out_dir / MARKER, _HEADER + "".join(f"{n}\n" for n in sorted(earlier | {*OWN})))
        images = draw_charts(runs, out_dir)
        sections = [
            _run_section(label, d, runs[label]) for label, d in zip(labels, run_dirs, strict=True)
        ]
        figures = "\n".join(
            f'<figure><img alt="{p.stem}" src="data:image/png;base64,'
            f'{base64.b64encode(p.read_bytes()).decode()}"></figure>'
            for p in images
        )
        title = "yatrain report: " + ", ".join(labels)
        page = _PAGE.format(title=html.escape(title), figures=figures, sections="\n".join(sections))
        return write_whole(out_dir / PAGE, page)
    except BaseException:
        if created:
            shutil.rmtree(out_dir, ignore_errors=True)
        raise


def _own_files(out_dir: Path) -> set[str]:
    """The files an earlier report wrote in ``out_dir`` (none when it is new or empty);
    ConfigError naming the problem when it is a link or holds anything else."""
    if out_dir.is_symlink():
        raise ConfigError(
            f"--output {out_dir} is a symbolic link (to {os.readlink(out_dir)}): a report "
            "does not write through links; name a new directory"
        )
    if not out_dir.is_dir():
        return set()  # new (a file in the way is make_directory's line)
    entries = sorted(entry.name for entry in out_dir.iterdir())
    own = _listed(out_dir / MARKER) if MARKER in entries else set()
    foreign = [name for name in entries if name != MARKER and name not in own]
    if foreign:
        raise ConfigError(
            f"--output {out_dir} holds {foreign[0]}"
            + (f" and {len(foreign) - 1} more" if len(foreign) > 1 else "")
            + ", which yatrain report did not write: a report replaces only its own files; "
            "choose a new or empty directory"
        )
    return own


def _listed(marker: Path) -> set[str]:
    """The names a report's marker lists (nothing when it is a link or unreadable: then
    every file there counts as someone else's)."""
    try:
        with open(marker, encoding="utf-8", opener=no_follow) as file:
            text = file.read(1 << 16)
    except (OSError, ConfigError, UnicodeDecodeError):
        return set()
    names = {line for line in text.splitlines() if line and not line.startswith("#")}
    return {name for name in names if "/" not in name and name not in (".", "..", MARKER)}


def _labels(run_dirs: list[Path]) -> list[str]:
    """Each run's directory name, with its parent when two names are the same."""
    names = [d.name for d in run_dirs]
    return [f"{d.parent.name}/{d.name}" if names.count(d.name) > 1 else d.name for d in run_dirs]


def _run_section(label: str, run_dir: Path, records: list[MetricsRecord]) -> str:
    """A run's summary table, its step-time shares, its stragglers and any hang report."""
    last = records[-1]
    summary = run_summary(records, float("nan"), run_dir, "-", 0)
    summary.pop("wall_time_s"), summary.pop("dtype"), summary.pop("world_size")
    timed = [r for r in records if r.compute_s is not None and r.step > 1] or [
        r for r in records if r.compute_s is not None
    ]
    shares = ""
    if timed:
        total = sum(r.step_time_s for r in timed)
        parts = ", ".join(
            f"{name} {sum(getattr(r, key) for r in timed) / total:.1%}"
            for key, name in BREAKDOWN.items()
        )
        shares = f"<p>Step time by part (after step 1): {html.escape(parts)}.</p>"
    if last.slowest_rank is not None and last.median_busy_s:
        ratio = last.slowest_busy_s / last.median_busy_s
        shares += (
            f"<p>At step {last.step} the slowest rank was {last.slowest_rank}, busy "
            f"{ratio:.2f}x the median.</p>"
        )
    hang = hang_dir(run_dir) / "report.txt"
    stuck = (
        f"<h3>Hang report</h3><pre>{html.escape(hang.read_text(errors='replace'))}</pre>"
        if hang.is_file()
        else ""
    )
    return (
        f"<section><h2>{html.escape(label)}</h2><p>{html.escape(str(run_dir))}, "
        f"{len(records)} records, last at step {last.step}.</p>"
        f"<pre>{html.escape(format_summary(summary))}</pre>{shares}{stuck}</section>"
    )


_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{title}</title>
<style>
body {{ font-family: sans-serif; margin: 2em; max-width: 1100px; }}
figure {{ display: inline-block; margin: 0.5em; }}
img {{ max-width: 100%; border: 1px solid #ddd; }}
pre {{ background: #f6f6f6; padding: 0.8em; overflow-x: auto; }}
</style>
</head>
<body>
<h1>{title}</h1>
{figures}
{sections}
</body>
</html>
"""
