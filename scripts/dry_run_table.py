"""Every shipped recipe's dry run at the cluster its header names, as one table.

Each recipe's header comment names the cluster it is shipped for, as the command that plans
it (``#   yatrain plan recipes/llama3_70b.yaml --gpus 256 --gpu-memory 79``); that line is
the one source of the GPUs, memory and any other flag: this script reads it, adds
``--dry-run --json`` and runs it, one process per recipe (a dry run joins a process group
of its own) and one at a time (each uses every core it is given). The answers go to
``docs/data/dry_runs.json`` (``--only`` replaces just the recipes it names there) and a
markdown table is printed: the one in docs/planner.md ("Every shipped recipe, dry run").

    python scripts/dry_run_table.py                       # every recipe (70B ones: minutes)
    python scripts/dry_run_table.py --only tiny --only llama3_2_1b
    python scripts/dry_run_table.py --json-in docs/data/dry_runs.json   # re-render only
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ROOT / "recipes"
OUT = ROOT / "docs" / "data" / "dry_runs.json"
LOGS = Path(tempfile.gettempdir()) / "dry_run_table"
GIB = 1024**3
# The header's plan line: "#   yatrain plan recipes/NAME.yaml FLAGS..."
PLAN_LINE = re.compile(r"^#\s+yatrain plan (?P<recipe>\S+\.yaml)(?P<flags>(?:\s+\S+)*)\s*$")
# The loop's line for each step (on stderr): "step      2 | ... | 41.3s/step | ..."
STEP_LINE = re.compile(r"^step\s+\d+ \|.*?\| (?P<seconds>[0-9.]+)s/step \|", re.MULTILINE)
COLUMNS = (
    "recipe",
    "GPUs",
    "GPU memory",
    "checkpointed layers",
    "planned peak",
    "tracked peak",
    "difference",
    "fits",
    "dry-run time",
)


def header_flags(recipe: Path) -> list[str]:
    """The flags of the ``yatrain plan`` line in ``recipe``'s header comment (the leading
    comment block), which must name the recipe itself; one line says what is missing."""
    for line in recipe.read_text().splitlines():
        if not line.startswith("#"):
            break  # the header ends at the first line that is not a comment
        found = PLAN_LINE.match(line)
        if found is None:
            continue
        if Path(found["recipe"]).name != recipe.name:
            raise ValueError(f"{recipe.name}: its header plans {found['recipe']}, not itself")
        return shlex.split(found["flags"])
    raise ValueError(f"{recipe.name}: no 'yatrain plan {recipe.name} --gpus N' in its header")


def flag_value(flags: list[str], name: str) -> str | None:
    """The value of ``--name V`` or ``--name=V`` in ``flags`` (None if absent)."""
    for i, flag in enumerate(flags):
        if flag == name and i + 1 < len(flags):
            return flags[i + 1]
        if flag.startswith(name + "="):
            return flag.split("=", 1)[1]
    return None


def dry_run_command(recipe: Path, flags: list[str]) -> list[str]:
    """The header's plan command as a dry run printing one JSON object."""
    name = recipe.relative_to(ROOT) if recipe.is_relative_to(ROOT) else recipe
    return [sys.executable, "-m", "yatrain", "plan", str(name), *flags, "--dry-run", "--json"]


def run_one(recipe: Path, timeout: float, logs: Path) -> dict:
    """One recipe's dry run in a process of its own: its JSON object, with the command and
    the process's wall time, or the error it ended with. Its stderr (the loop's step lines)
    goes to ``logs/NAME.log`` as it runs: a 70B dry run takes minutes."""
    flags = header_flags(recipe)
    command = dry_run_command(recipe, flags)
    shown = shlex.join(["yatrain", *command[3:]])
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{recipe.stem}.log"
    print(f"$ {shown}  (stderr: {log})", file=sys.stderr, flush=True)
    start = time.perf_counter()
    with log.open("w") as err:
        try:
            done = subprocess.run(
                command, cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True, timeout=timeout
            )
        except subprocess.TimeoutExpired:
            return {"recipe": recipe.name, "command": shown, "error": f"timed out after {timeout}s"}
    wall = time.perf_counter() - start
    result = {"recipe": recipe.name, "command": shown, "wall_seconds": round(wall, 1)}
    stderr = log.read_text()
    steps = [float(m["seconds"]) for m in STEP_LINE.finditer(stderr)]
    if steps:  # the last (steady-state) step's own time, as the loop measured it
        result["last_step_seconds"] = steps[-1]
    objects = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not objects:
        tail = (stderr.strip().splitlines() or ["(no output)"])[-1]
        return {**result, "error": f"exit {done.returncode}: {tail}"}
    return {**result, **json.loads(objects[-1])}


def gib(nbytes: int | None) -> str:
    return "n/a" if nbytes is None else f"{nbytes / GIB:.2f} GiB"


def row(result: dict) -> list[str]:
    """One table row: what the header asked for, then what the dry run measured."""
    flags = shlex.split(result["command"])
    gpus = flag_value(flags, "--gpus") or "?"
    memory = flag_value(flags, "--gpu-memory")
    memory = f"{memory} GiB" if memory else "?"
    name = f"`{result['recipe']}`"
    if "error" in result:
        return [name, gpus, memory, "", "", "", "", f"failed: {result['error']}", ""]
    planned, tracked = result["planned_peak_bytes"], result["tracked_peak_bytes"]
    difference = (tracked - planned) / planned * 100
    fits = {True: "yes", False: "no", None: "n/a"}[result["fits"]]
    seconds = f"{result['seconds']:.0f} s"
    if "last_step_seconds" in result:
        seconds += f" ({result['last_step_seconds']:.0f} s the last step)"
    return [
        name,
        gpus,
        memory,
        str(result["activation_checkpoint_layers"]),
        gib(planned),
        gib(tracked),
        f"{difference:+.2f}%",
        fits,
        seconds,
    ]


def table(results: list[dict]) -> str:
    """The markdown table of ``results``, in the order given."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row(result)) + " |" for result in results]
    return "\n".join(lines)


def recipes(only: list[str]) -> list[Path]:
    """The shipped recipes, or those ``only`` names (``tiny`` or ``tiny.yaml``)."""
    every = sorted(RECIPES.glob("*.yaml"))
    if not only:
        return every
    wanted = {name.removesuffix(".yaml") for name in only}
    unknown = wanted - {path.stem for path in every}
    if unknown:
        raise SystemExit(f"no recipe named {', '.join(sorted(unknown))} in {RECIPES}")
    return [path for path in every if path.stem in wanted]


def merged(saved: Path, fresh: list[dict]) -> list[dict]:
    """The saved results with ``fresh`` in place of the same recipes', in recipe order."""
    by_name = {r["recipe"]: r for r in json.loads(saved.read_text())} if saved.exists() else {}
    by_name.update({r["recipe"]: r for r in fresh})
    order = [path.name for path in sorted(RECIPES.glob("*.yaml"))]
    return sorted(by_name.values(), key=lambda r: (r["recipe"] not in order, r["recipe"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", default=[], help="a recipe (repeatable)")
    parser.add_argument("--json-in", type=Path, help="render this file's results; run nothing")
    parser.add_argument("--out", type=Path, default=OUT, help="where the results go")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per dry run")
    parser.add_argument("--logs", type=Path, default=LOGS, help="each dry run's stderr here")
    args = parser.parse_args(argv)
    if args.json_in is not None:
        print(table(json.loads(args.json_in.read_text())))
        return 0
    fresh = []
    for recipe in recipes(args.only):
        fresh.append(run_one(recipe, args.timeout, args.logs))
        print(table(fresh[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    results = merged(args.out, fresh)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))
    return 1 if any("error" in r for r in fresh) else 0


if __name__ == "__main__":
    sys.exit(main())
