"""One ``yatrain pretrain`` in a child process, exactly as a user runs it.

The benchmarks that measure a recipe key through the CLI (``compile``, ``float8``) run it
here and read what the run wrote: its ``metrics.jsonl`` records, and its console output for
lines the records do not hold.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def run_pretrain(
    bench: str,
    recipe: str,
    run_dir: Path,
    steps: int,
    sets: list[str],
    env: dict[str, str] | None = None,
) -> tuple[list[dict], str]:
    """(the run's metrics records, its stderr). A failed run ends the benchmark ``bench``
    with the run's own last lines."""
    command = [
        sys.executable,
        "-m",
        "yatrain",
        "pretrain",
        recipe,
        "--run-dir",
        str(run_dir),
        "--steps",
        str(steps),
        "--no-progress",
        *[f"--set={s}" for s in sets],
    ]
    done = subprocess.run(command, capture_output=True, text=True, env=os.environ | (env or {}))
    if done.returncode != 0:
        raise SystemExit(f"bench {bench}: yatrain pretrain failed:\n{done.stderr[-2000:]}")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines], done.stderr
