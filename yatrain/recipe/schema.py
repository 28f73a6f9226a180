"""Parsed YAML into checked dataclasses: the generic half of the recipe schema.

A dataclass is the schema: its field names are the keys, its type hints the types (int,
float, str, bool, Literal choices, ``X | None``, unions such as ``int | Literal["auto"]``,
nested dataclasses), and ``limit`` puts range bounds in a field's metadata (``key`` names a
field whose YAML key is a Python keyword, such as ``async``). Every problem is one
``ConfigError`` line naming the dotted key and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from dataclasses import field
from typing import Any, Literal

from yatrain.errors import ConfigError


def limit(
    default: Any = dataclasses.MISSING,
    *,
    ge: float | None = None,
    gt: float | None = None,
    lt: float | None = None,
    le: float | None = None,
    cap: int | None = None,
    key: str | None = None,
) -> Any:
    """A dataclass field with range bounds that validation enforces (ge: >=, gt: >, lt: <,
    le: <=). ``cap``: an upper bound of size (<=) that keeps absurd values (a million
    layers) out of the allocator. ``key``: the field's YAML key when it is not the
    field's name (``async``)."""
    meta = {"ge": ge, "gt": gt, "lt": lt, "le": le, "cap": cap, **({"key": key} if key else {})}
    return field(default=default, metadata=meta)


def yaml_key(f: dataclasses.Field) -> str:
    """The YAML key of a dataclass field (its name unless ``limit(key=...)`` says otherwise)."""
    return f.metadata.get("key", f.name)


def to_dict(obj: Any) -> Any:
    """Plain nested dicts of a schema dataclass under its YAML keys (``build_dataclass``'s
    inverse)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {yaml_key(f): to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, list):
        return [to_dict(item) for item in obj]
    return obj


def build_dataclass(cls: type, d: Any, prefix: str = "") -> Any:
    """Instantiate dataclass cls from mapping d, checking keys, types and ranges."""
    where = prefix.rstrip(".") or "the recipe"
    if d is None:  # an empty section ("logging:" with everything commented out)
        d = {}
    if not isinstance(d, dict):
        raise ConfigError(f"'{where}' must be a mapping of keys, got {_show(d)}")
    fields = {yaml_key(f): f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for key in d:
        if key not in fields:
            name = f"{prefix}{key}"
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = (
                f"did you mean '{prefix}{close[0]}'?"
                if close
                else f"valid keys in '{where}' are: {', '.join(fields)}"
            )
            raise ConfigError(f"unknown key '{name}'; {hint}")
    kwargs = {}
    for name, f in fields.items():  # name: the YAML key
        key = f"{prefix}{name}"
        if name not in d:
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            if required:
                raise ConfigError(
                    f"missing required key '{key}'; add it to the recipe "
                    "(see recipes/llama3_8b.yaml for a complete example)"
                )
            continue
        value = _coerce(key, d[name], hints[f.name])
        _check_range(key, value, f.metadata)
        kwargs[f.name] = value
    return cls(**kwargs)


def _show(v: Any) -> str:
    return "null" if v is None else f"{v!r} ({type(v).__name__})"


_TYPE_WORDS = {int: "whole number", float: "number", str: "string"}


def _coerce(key: str, v: Any, tp: Any) -> Any:
    """Check v against the annotation tp, converting only int->float and numeric str->float."""
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return build_dataclass(tp, v, prefix=f"{key}.")
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        if v not in args or isinstance(v, bool):
            choices = ", ".join(repr(a) for a in args)
            note = " (YAML reads on/off/yes/no as booleans)" if isinstance(v, bool) else ""
            raise ConfigError(
                f"'{key}' has invalid value {_show(v)}{note}; choose one of {choices}"
            )
        return v
    if origin is list:
        if not isinstance(v, list):
            raise ConfigError(f"'{key}' must be a list, got {_show(v)}")
        return [_coerce(f"{key}[{i}]", item, args[0]) for i, item in enumerate(v)]
    if args and type(None) not in args and len(args) > 1:  # int | Literal["auto"]: first fit
        for member in args:
            try:
                return _coerce(key, v, member)
            except ConfigError:
                pass
        words = " or ".join(
            repr(a) if not isinstance(a, type) else f"a {_TYPE_WORDS.get(a, a.__name__)}"
            for m in args
            for a in (typing.get_args(m) or (m,))
        )
        raise ConfigError(f"'{key}' must be {words}, got {_show(v)}")
    if args and type(None) in args:  # Optional[X]: None, or an X
        inner = [a for a in args if a is not type(None)]
        member = inner[0] if len(inner) == 1 else typing.Union[tuple(inner)]  # noqa: UP007
        return None if v is None else _coerce(key, v, member)
    if tp is int:
        if isinstance(v, int) and not isinstance(v, bool):
            return v
        example = f" such as {int(v)}" if isinstance(v, float) and math.isfinite(v) else ""
        raise ConfigError(
            f"'{key}' must be a whole number, got {_show(v)}; write an integer{example}"
        )
    if tp is float:
        try:  # YAML reads 3e-4 (no dot) as a string: accept numeric strings
            x = float(v) if not isinstance(v, bool) else math.nan
        except (TypeError, ValueError):
            x = math.nan
        if not math.isfinite(x):
            raise ConfigError(f"'{key}' must be a finite number, got {_show(v)}; write e.g. 3.0e-4")
        return x
    if tp is str:
        if not isinstance(v, str):
            raise ConfigError(
                f"'{key}' must be a string, got {_show(v)}; quote it, "
                f'e.g. {key.rsplit(".", 1)[-1]}: "{v}"'
            )
        return v
    if tp is bool:
        if not isinstance(v, bool):
            raise ConfigError(f"'{key}' must be true or false, got {_show(v)}")
        return v
    raise TypeError(f"unsupported schema type {tp!r} for {key}")  # a bug in the schema


def _check_range(key: str, v: Any, meta: Any) -> None:
    if v is None or isinstance(v, str):  # ranges bound numbers only ("auto" has none)
        return
    ge, gt, lt, le = meta.get("ge"), meta.get("gt"), meta.get("lt"), meta.get("le")
    if ge is not None and v < ge:
        bound = {0: "non-negative", 1: "positive"}.get(ge, f"at least {ge}")
        raise ConfigError(f"'{key}' must be {bound}, got {v}; set it to {ge} or more")
    if gt is not None and v <= gt:
        bound = "positive" if gt == 0 else f"greater than {gt}"
        raise ConfigError(f"'{key}' must be {bound}, got {v}; use a value above {gt}")
    if lt is not None and v >= lt:
        raise ConfigError(f"'{key}' must be less than {lt}, got {v}; use a value below {lt}")
    if le is not None and v > le:
        low = f"above {gt} and " if gt is not None else f"at least {ge} and " if ge else ""
        raise ConfigError(f"'{key}' must be {low}at most {le}, got {v}; use a value in that range")
    cap = meta.get("cap")
    if cap is not None and v > cap:
        raise ConfigError(
            f"'{key}' must be at most {cap:,}, got {v:,}: far beyond any model that fits on "
            "today's hardware; check the value"
        )
