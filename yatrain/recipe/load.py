"""A recipe read, built and checked: ``load_recipe`` (a YAML file and ``--set`` overrides)
and ``recipe_from_dict`` (plain nested dicts).

It sits above the schema (``config``) and its cross-field checks (``recipe.checks``): the
schema names no check and the checks import the schema's types at run time, so the three
form no cycle, not even a type-only one (pyproject: ``exclude_type_checking_imports = false``).
"""

from __future__ import annotations

import stat
from collections.abc import Sequence
from pathlib import Path

import yaml

from yatrain.errors import ConfigError
from yatrain.recipe.checks import check_shapes
from yatrain.recipe.config import Recipe
from yatrain.recipe.schema import build_dataclass


def load_recipe(path: str | Path, overrides: Sequence[str] = ()) -> Recipe:
    """Read a YAML recipe, apply ``dotted.key=value`` overrides, build and validate it."""
    path = Path(path)
    check_recipe_path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{path} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}): "
            "save the recipe as UTF-8"
        ) from None
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply to be a recipe; fix the file") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{path}{where}: invalid YAML ({problem}); fix the syntax there") from e
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{path}: the recipe must be a YAML mapping of sections "
            f"(model:, data:, ...), got a {type(raw).__name__}"
        )
    for item in overrides:
        _apply_override(raw, item)
    try:
        return recipe_from_dict(raw)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    except RecursionError:
        raise ConfigError(f"{path}: a value is nested too deeply; fix it") from None


def check_recipe_path(path: Path) -> None:
    """A recipe is a file that exists: a directory (``recipes/``) is named as one, with a
    recipe in it to pass, and a FIFO or device is refused before it is read (it would block)."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise ConfigError(
            f"recipe file '{path}' not found; pass the path of a YAML recipe "
            "such as recipes/tiny.yaml"
        ) from None
    except OSError as e:
        raise ConfigError(f"cannot read the recipe {path} ({e.strerror}); pass another") from None
    if stat.S_ISDIR(mode):
        inside = sorted(p.name for p in path.glob("*.yaml"))
        example = path / inside[0] if inside else Path("recipes/tiny.yaml")
        raise ConfigError(
            f"recipe {path} is a directory, not a recipe file; pass one YAML recipe, such as "
            f"{example}"
        )
    if not stat.S_ISREG(mode):
        raise ConfigError(f"recipe {path} is not a regular file; pass the path of a YAML recipe")


def _apply_override(d: dict, item: str) -> None:
    """Set ``a.b.c=value`` in the nested dict d; value is parsed as YAML (so 2 is an int)."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(
            f"malformed override '{item}'; write --set dotted.key=value, "
            "e.g. --set model.n_layers=2"
        )
    try:
        value = yaml.safe_load(text)
    except RecursionError:
        raise ConfigError(f"override '{key}': its value is nested too deeply; fix it") from None
    except yaml.YAMLError as e:
        raise ConfigError(
            f"override '{item}': value '{text}' is not valid YAML; quote it or fix it"
        ) from e
    *parents, leaf = key.split(".")
    node = d
    for i, part in enumerate(parents):
        child = node.setdefault(part, {})
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            dotted = ".".join(parents[: i + 1])
            raise ConfigError(
                f"override '{item}': '{dotted}' is a value, not a section; "
                f"set '{dotted}=...' instead"
            )
        node = child
    node[leaf] = value


def recipe_from_dict(d: dict) -> Recipe:
    """Build a validated Recipe from plain nested dicts (as parsed from YAML)."""
    recipe = build_dataclass(Recipe, d)
    check_shapes(recipe)
    return recipe
