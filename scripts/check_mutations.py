"""Plant realistic one-line bugs, one at a time, and show the tests that cover each module fail.

    .venv/bin/python scripts/check_mutations.py              # every mutation in scripts/mutations/
    .venv/bin/python scripts/check_mutations.py --only K2 M3 # some of them, by id

The mutations are listed in ``scripts/mutations/*.yaml``, one entry each: an ``id``, the
``behaviour`` a user relies on, the ``file`` and the exact ``line`` it changes (stripped; it must
occur exactly once in that file), what the line ``becomes``, and the ``tests`` files a developer
would run for that module. The working tree (tracked and untracked files, not the ignored ones)
is copied to a temporary clone; each mutation is planted there alone, the clone's tests run with
``pytest -x`` against the clone's package (PYTHONPATH, which the tests' subprocesses inherit),
and the file is restored. First the unmutated clone must pass every test file named.

Each line of the report says CAUGHT (the tests failed) or MISSED; the exit status is non-zero
when any mutation is missed, cannot be planted, or the unmutated tests fail.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
MUTATIONS = REPO / "scripts" / "mutations"
TIMEOUT_S = 900  # one mutation's test run; a hang counts as caught only if it fails


def load_mutations() -> list[dict]:
    entries: list[dict] = []
    for file in sorted(MUTATIONS.glob("*.yaml")):
        for entry in yaml.safe_load(file.read_text()) or []:
            missing = {"id", "behaviour", "file", "line", "becomes", "tests"} - set(entry)
            if missing:
                sys.exit(f"{file}: entry {entry.get('id')!r} lacks {sorted(missing)}")
            entries.append(entry)
    ids = [e["id"] for e in entries]
    if len(ids) != len(set(ids)):
        sys.exit(f"duplicate mutation ids in {MUTATIONS}")
    return entries


def clone_working_tree(target: Path) -> None:
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    for name in filter(None, (n.decode() for n in listed)):
        source = REPO / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)


def plant(clone: Path, entry: dict) -> str | None:
    """Change the entry's line in the clone; None when planted, else why it cannot be."""
    path = clone / entry["file"]
    if not path.is_file():
        return f"{entry['file']} does not exist"
    lines = path.read_text().splitlines(keepends=True)
    hits = [i for i, line in enumerate(lines) if line.strip() == entry["line"].strip()]
    if len(hits) != 1:
        return f"{len(hits)} lines of {entry['file']} read {entry['line']!r} (want exactly 1)"
    old = lines[hits[0]]
    indent = old[: len(old) - len(old.lstrip())]
    lines[hits[0]] = f"{indent}{entry['becomes']}\n"
    path.write_text("".join(lines))
    try:
        compile(path.read_text(), str(path), "exec")
    except SyntaxError as e:
        return f"the planted line is not valid Python: {e}"
    return None


def run_tests(clone: Path, tests: list[str]) -> tuple[bool, str, float]:
    """(passed, the first failure or the summary line, seconds)."""
    env = {**os.environ, "PYTHONPATH": str(clone)}
    began = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
            cwd=clone,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return False, f"timed out after {TIMEOUT_S} s", time.monotonic() - began
    lines = done.stdout.strip().splitlines() or ["(no output)"]
    failed = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
    return done.returncode == 0, (failed or lines)[-1][:160], time.monotonic() - began


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="*", help="mutation ids to run (default: all)")
    args = parser.parse_args()
    entries = load_mutations()
    if args.only:
        unknown = set(args.only) - {e["id"] for e in entries}
        if unknown:
            sys.exit(f"unknown mutation ids: {sorted(unknown)}")
        entries = [e for e in entries if e["id"] in args.only]
    status = 0
    with tempfile.TemporaryDirectory(prefix="yatrain-mutations-") as scratch:
        clone = Path(scratch)
        clone_working_tree(clone)
        test_files = sorted({t for e in entries for t in e["tests"]})
        passed, detail, seconds = run_tests(clone, test_files)
        print(f"unmutated: {'PASS' if passed else 'FAIL'} in {seconds:.0f} s ({detail})")
        if not passed:
            return 1
        caught = 0
        for entry in entries:
            original = (clone / entry["file"]).read_bytes()
            why = plant(clone, entry)
            if why is not None:
                print(f"{entry['id']:4} CANNOT PLANT  {why}")
                status = 1
                continue
            passed, detail, seconds = run_tests(clone, entry["tests"])
            (clone / entry["file"]).write_bytes(original)
            caught += not passed
            status |= passed
            verdict = "MISSED" if passed else "CAUGHT"
            print(f"{entry['id']:4} {verdict}  {seconds:4.0f} s  {entry['behaviour']}")
            print(f"     {entry['file']}: {entry['line'].strip()}  ->  {entry['becomes']}")
            print(f"     {detail}")
        print(f"{caught} of {len(entries)} one-line bugs caught")
    return status


if __name__ == "__main__":
    sys.exit(main())
