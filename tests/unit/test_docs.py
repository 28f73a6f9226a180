"""The front page and the guides stay true: every relative link and #anchor in README.md and
the pages under docs/ (the result files in its subfolders too) resolves (GitHub's heading
slugs), every recipe key they name (``section.key`` in backticks) is in the schema, and every
``yatrain COMMAND`` they show is a command."""

from __future__ import annotations

import dataclasses
import re
import shlex
import types
import typing
from pathlib import Path

from conftest import ROOT

from yatrain.cli import app
from yatrain.recipe.config import Recipe

# docs/benchmarks/ holds dated result files the guides link to: checked like the guides.
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
INLINE_CODE = re.compile(r"`([^`\n]+)`")
# A command line: a code line or inline code that starts with it (after a "$ " prompt), or a
# module run (python -m yatrain ..., torchrun ... -m yatrain ...).
COMMAND = re.compile(r"(?:^[$ ]*|-m )yatrain ([a-z][a-z0-9-]*)", re.M)
FILE_NAME = re.compile(r"\.(safetensors|json|jsonl|yaml|yml|bin|model|png|html|py|md|txt|pt)$")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    counts: dict[str, int] = {}
    for line in FENCE.sub("", page.read_text()).splitlines():
        if match := re.match(r"#{1,6} (.+)", line):
            base = slug(match.group(1))
            n = counts.get(base, 0)
            counts[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def name(page: Path) -> str:
    """A page as the failures name it: docs/benchmarks/X.md, not X.md alone."""
    return str(page.relative_to(ROOT))


def test_pages_include_the_subfolders():
    assert ROOT / "README.md" in PAGES and ROOT / "docs" / "benchmarks.md" in PAGES
    assert any(page.parent.name == "benchmarks" for page in PAGES)


def test_slugs_follow_github():
    assert slug("Why is my run slow / stuck?") == "why-is-my-run-slow--stuck"
    assert slug("`yatrain plan`") == "yatrain-plan"
    assert slug("Continue pretraining Llama 3.1 8B on your data") == (
        "continue-pretraining-llama-31-8b-on-your-data"
    )


def test_every_relative_link_and_anchor_resolves():
    broken = []
    for page in PAGES:
        for target in LINK.findall(FENCE.sub("", page.read_text())):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            path, _, anchor = target.partition("#")
            where = (page.parent / path).resolve() if path else page
            if not where.exists():
                broken.append(f"{name(page)}: {target} (no such file)")
            elif anchor and (where.suffix != ".md" or anchor not in anchors(where)):
                broken.append(f"{name(page)}: {target} (no such heading)")
    assert broken == []


def _schema_keys(cls: type, prefix: str = "") -> set[str]:
    keys = set()
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        key = f"{prefix}{field.name}"
        keys.add(key)
        for kind in _dataclasses_in(hints[field.name]):
            keys |= _schema_keys(kind, key + ".")
    return keys


def _dataclasses_in(hint: object) -> list[type]:
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return [hint]
    if typing.get_origin(hint) in (typing.Union, types.UnionType, list, tuple, dict):
        return [k for arg in typing.get_args(hint) for k in _dataclasses_in(arg)]
    return []


def test_every_recipe_key_the_docs_name_exists():
    keys = _schema_keys(Recipe)
    sections = "|".join(f.name for f in dataclasses.fields(Recipe))
    dotted = re.compile(rf"^(?:--set[= ])?((?:{sections})(?:\.[a-z_0-9]+)+)(?:[=:].*)?$")
    unknown, checked = [], 0
    for page in PAGES:
        for code in INLINE_CODE.findall(FENCE.sub("", page.read_text())):
            match = dotted.match(code.strip())
            checked += match is not None
            if not match or match.group(1) in keys or FILE_NAME.search(match.group(1)):
                continue
            module = ROOT / "yatrain" / match.group(1).replace(".", "/")
            if module.with_suffix(".py").exists() or module.is_dir():
                continue  # a module named by its dotted path (train.compile, data.split)
            if _names_a_module_member(match.group(1)):
                continue
            unknown.append(f"{name(page)}: `{code}`")
    assert checked > 100  # the guides name many keys: the pattern finds them
    assert unknown == []


def _names_a_module_member(dotted: str) -> bool:
    """``train.compile.compile_layers``: a name inside a module of the package."""
    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module = ROOT / "yatrain" / "/".join(parts[:cut])
        if module.with_suffix(".py").exists() or (module / "__init__.py").exists():
            return True
    return False


def test_every_command_the_docs_show_exists():
    commands = {c.name or c.callback.__name__.replace("_", "-") for c in app.registered_commands}
    unknown, shown = [], set()
    for page in PAGES:
        text = page.read_text()
        code = [m.group(0) for m in FENCE.finditer(text)] + INLINE_CODE.findall(FENCE.sub("", text))
        for snippet in code:
            for command in COMMAND.findall(snippet):
                shown.add(command)
                if command not in commands:
                    unknown.append(f"{name(page)}: yatrain {command}")
    assert shown >= {"pretrain", "prepare-data", "plan", "eval", "generate", "export", "sweep"}
    assert unknown == []


# Inline code may wrap onto the next line of its paragraph (never across a blank line).
WRAPPED_CODE = re.compile(r"`([^`\n]+(?:\n[^`\n]+)*)`")
PLACEHOLDER = re.compile(r"^[A-Z][A-Z_]*$|\.\.\.|\[")  # RECIPE, N, [--flag ...]


def planner_commands() -> list[tuple[str, list[str]]]:
    """Every ``yatrain plan`` and ``yatrain sweep --plan-only`` line of the PAGES, fenced or
    inline (a usage line with placeholders is skipped): (page, the arguments after
    ``yatrain``)."""
    found = []
    for page in PAGES:
        text = page.read_text()
        lines = [
            line
            for fence in FENCE.finditer(text)
            for line in fence.group(0).replace("\\\n", " ").splitlines()
        ]
        lines += [code.replace("\n", " ") for code in WRAPPED_CODE.findall(FENCE.sub("", text))]
        for line in lines:
            line = line.split(" #")[0].strip().removeprefix("$ ")
            if not re.match(r"yatrain (plan|sweep) ", line):
                continue
            words = shlex.split(line)
            if words[1] == "sweep" and "--plan-only" not in words:
                continue
            if not any(PLACEHOLDER.search(w) for w in words):
                found.append((name(page), words[1:]))
    return found


def test_every_plan_and_plan_only_sweep_the_docs_show_runs(tmp_path, monkeypatch):
    """No model is built for these: each is the planner alone, run in-process."""
    from typer.testing import CliRunner

    monkeypatch.chdir(ROOT)
    commands = planner_commands()
    failed = []
    for i, (page, args) in enumerate(commands):
        if args[0] == "sweep":
            args = [*args, "--output", str(tmp_path / f"sweep-{i}")]
        result = CliRunner().invoke(app, args)
        if result.exit_code != 0:
            error = result.output.strip() or repr(result.exception)
            failed.append(f"{page}: yatrain {' '.join(args)}: {error}")
    assert {a[0] for _, a in commands} == {"plan", "sweep"} and len(commands) > 10
    assert failed == []
