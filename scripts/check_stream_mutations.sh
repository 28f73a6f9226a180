#!/usr/bin/env bash
# Mutation check for tests/unit/test_cuda_stream_order.py: the fake-CUDA test must catch each
# removed stream wait and each early release of a gradient.  bash scripts/check_stream_mutations.sh
#
# Copies the repo's yatrain/ into a scratch dir, applies one mutation at a time to the copy,
# runs the test with PYTHONPATH=<scratch> (so the copy is imported: the repo's editable
# install comes after PYTHONPATH) and prints the mutated file:line, the line and PASS/FAIL.
# Lines are found by their content under yatrain/sharding/, not by number:
#   - every `.wait_event(` call there, each removed in turn (found anew each run, so a
#     refactor that moves or adds one is still covered);
#   - "release early": the reducer lets autograd's gradient go before the communication
#     stream's reduction of it is done (three ways, below).
# Expected: FAIL (caught) for every mutation, then PASS for the unmutated copy; exit 0 then.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
export PATH="$REPO/.venv/bin:$PATH"
SCRATCH=$(mktemp -d)
trap 'rm -rf "$SCRATCH"' EXIT

python - "$REPO" "$SCRATCH" <<'PY'
import re
import shutil
import subprocess
import sys
from pathlib import Path

repo, scratch = Path(sys.argv[1]), Path(sys.argv[2])
TEST = "tests/unit/test_cuda_stream_order.py"
# (what it does, regex of the one line it changes, the statement put there instead)
RELEASE_EARLY = [
    ("pump frees the source without asking whether its collectives finished",
     r"while pending and all\(.*finished", "while pending:"),
    ("release() drops the source without the compute stream waiting",
     r"^\s*self\.comm\.wait\(handle\)\s*$", "pass"),
    ("the CUDA communicator says a collective finished before its event did",
     r"return handle is None or handle\.done or .*\.query\(\)", "return True"),
]


def fresh_copy() -> Path:
    target = scratch / "yatrain"
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(repo / "yatrain", target, ignore=shutil.ignore_patterns("__pycache__"))
    return target / "sharding"


def lines_matching(sharding: Path, pattern: str) -> list[tuple[Path, int]]:
    return [
        (path, number)
        for path in sorted(sharding.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(pattern, line) and not line.lstrip().startswith("#")
    ]


def mutate(path: Path, number: int, statement: str) -> str:
    lines = path.read_text().splitlines(keepends=True)
    old = lines[number - 1]
    indent = old[: len(old) - len(old.lstrip())]
    lines[number - 1] = f"{indent}{statement}  # MUTATED\n"
    path.write_text("".join(lines))
    compile(path.read_text(), str(path), "exec")  # still valid Python
    return f"{path.relative_to(scratch)}:{number}: {old.strip()}\n    -> {statement}"


def run_test() -> tuple[bool, str]:
    env = {**__import__("os").environ, "PYTHONPATH": str(scratch)}
    done = subprocess.run(
        ["pytest", "-x", "-q", "-p", "no:cacheprovider", TEST],
        cwd=repo, env=env, capture_output=True, text=True, timeout=600,
    )
    found = re.search(r"(rank \d+: \d+ ordering breaches):\nE +(.*)", done.stdout)
    if found:
        return done.returncode == 0, f"{found.group(1)}, the first:\n      {found.group(2)}"
    detail = (done.stdout.strip().splitlines() or ["?"])[-1]
    return done.returncode == 0, detail


sharding = fresh_copy()
where = subprocess.run(
    ["python", "-c", "import yatrain.sharding.comm as c; print(c.__file__)"],
    env={**__import__("os").environ, "PYTHONPATH": str(scratch)}, cwd="/",
    capture_output=True, text=True,
).stdout.strip()
print(f"the test imports {where}")
waits = lines_matching(sharding, r"\.wait_event\(")
print(f"{len(waits)} wait_event calls under yatrain/sharding/")
mutations = [("remove a wait_event", path.relative_to(sharding), number, "pass")
             for path, number in waits]
for what, pattern, statement in RELEASE_EARLY:
    hits = lines_matching(sharding, pattern)
    if len(hits) != 1:
        print(f"MISSING: {what}: {len(hits)} lines match {pattern!r} (want 1)")
        mutations.append((what, None, 0, statement))
        continue
    mutations.append((what, hits[0][0].relative_to(sharding), hits[0][1], statement))

status = 0
for what, relative, number, statement in mutations:
    if relative is None:
        status = 1
        continue
    sharding = fresh_copy()
    print(f"[{what}] {mutate(sharding / relative, number, statement)}")
    passed, detail = run_test()
    print(f"    test: {'PASS (NOT caught)' if passed else 'FAIL (caught)'}: {detail}")
    status |= passed
fresh_copy()
passed, detail = run_test()
print(f"[unmutated copy] test: {'PASS' if passed else 'FAIL'}: {detail}")
status |= not passed
sys.exit(status)
PY
