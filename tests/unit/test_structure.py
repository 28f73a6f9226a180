"""The shape of the code (docs/architecture.md): small files, short functions, no path hacks.

The package layering itself is checked by ``lint-imports`` (contracts in pyproject.toml).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from conftest import ROOT

PACKAGE = ROOT / "yatrain"
MAX_FILE_LINES, MAX_BENCH_FILE_LINES, MAX_FUNCTION_LINES = 350, 300, 60
MAX_TRAIN_LINES = 2400  # the loop's room: what is not the loop or a cadence lives elsewhere
# What every layer uses stays at the root; everything else has a room of its own.
ROOT_MODULES = {"__init__.py", "__main__.py", "common.py", "errors.py", "files.py"}


def sources(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.py"))


def longer_than(paths: list[Path], limit: int) -> dict[str, int]:
    lengths = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in paths}
    return {name: n for name, n in lengths.items() if n > limit}


def test_no_file_in_the_package_is_too_long():
    assert longer_than(sources(PACKAGE), MAX_FILE_LINES) == {}


def test_the_training_package_stays_under_its_cap():
    lines = sum(len(p.read_text().splitlines()) for p in sources(PACKAGE / "train"))
    assert lines < MAX_TRAIN_LINES


def test_the_package_root_holds_only_what_every_layer_uses():
    assert {p.name for p in PACKAGE.glob("*.py")} == ROOT_MODULES


def test_no_benchmark_file_is_too_long():
    bench = sources(ROOT / "scripts")  # scripts/bench/ and the shims
    assert longer_than(bench, MAX_BENCH_FILE_LINES) == {}


def test_no_function_in_the_package_is_too_long():
    long = {}
    for path in sources(PACKAGE):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"] = lines
    assert long == {}


@pytest.mark.parametrize("folder", ["yatrain", "scripts", "tests"])
def test_nothing_edits_sys_path(folder):
    """Benchmarks and tests import yatrain as installed (scripts/setup.sh), never by path."""
    edits = ("sys.path." + "insert", "sys.path." + "append")  # split: this file is scanned too
    found = [
        str(p.relative_to(ROOT))
        for p in sources(ROOT / folder)
        if any(edit in p.read_text() for edit in edits)
    ]
    assert found == []


# Where the package may read or set environment variables: the command line and the runtime
# own the process's environment; anything below them is handed what it needs. The exceptions
# and why each must touch the environment itself:
ENVIRONMENT_OWNERS = ("yatrain/cli/", "yatrain/runtime/")
ENVIRONMENT_EXCEPTIONS = {
    "yatrain/output/wandb_logger.py": "W&B is configured by its own variables (WANDB_MODE, ...)",
    "yatrain/data/parallel.py": "tokenizers reads its thread count from each worker's env",
    "yatrain/sweep/run.py": "a launcher: each configuration's process inherits this one's env",
    "yatrain/testing/ranks.py": "sets what torchrun would for test and benchmark ranks",
}


def environment_uses(path: Path) -> list[int]:
    """Lines that touch ``os.environ`` or call ``os.getenv`` (or a bare ``environ``)."""
    names = {"environ", "getenv", "putenv"}
    return [
        node.lineno
        for node in ast.walk(ast.parse(path.read_text()))
        if (isinstance(node, ast.Attribute) and node.attr in names)
        or (isinstance(node, ast.Name) and node.id in names)
    ]


def test_only_the_cli_and_the_runtime_read_the_environment():
    found = {
        str(p.relative_to(ROOT)): lines for p in sources(PACKAGE) if (lines := environment_uses(p))
    }
    below = {name for name in found if not name.startswith(ENVIRONMENT_OWNERS)}
    assert below == set(ENVIRONMENT_EXCEPTIONS), {n: found.get(n) for n in below}
    assert any(name.startswith("yatrain/runtime/") for name in found)  # the scan sees reads
