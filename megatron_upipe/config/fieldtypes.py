"""Type rules shared by the config schema and the loader: ConfigError, and value-vs-annotation checks.

Supported annotations: bool, int, float, str, None, `X | None`, unions, `list[X]` and `Literal[...]` (choices).
`coerce` is what the loader applies to YAML / command-line values; `matches` is the strict check each dataclass
runs in `__post_init__`, so a config built directly in Python is held to the same types.
"""

from __future__ import annotations

import difflib
import types
from typing import Any, Literal, Union, get_args, get_origin

_FAIL = object()


class ConfigError(ValueError):
    """A configuration the trainer refuses; the message names the setting(s) and the fix."""


def closest(word: str, candidates: list[str]) -> str | None:
    hits = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    return hits[0] if hits else None


def type_name(ann: Any) -> str:
    origin = get_origin(ann)
    if origin in (Union, types.UnionType):
        return " or ".join(type_name(a) for a in get_args(ann))
    if origin is Literal:
        return "one of " + "|".join(str(a) for a in get_args(ann))
    if origin is list:
        return f"list of {type_name(get_args(ann)[0])}"
    return "null" if ann is type(None) else getattr(ann, "__name__", str(ann))


def _coerce(v: Any, ann: Any, lenient: bool = True) -> Any:
    origin = get_origin(ann)
    if origin in (Union, types.UnionType):
        for member in get_args(ann):
            out = _coerce(v, member, lenient)
            if out is not _FAIL:
                return out
        return _FAIL
    if origin is Literal:
        return v if isinstance(v, str) and v in get_args(ann) else _FAIL
    if origin is list:
        if not isinstance(v, list):
            return _FAIL
        out = [_coerce(x, get_args(ann)[0], lenient) for x in v]
        return _FAIL if any(x is _FAIL for x in out) else out
    if ann is type(None):
        return v if v is None else _FAIL
    if ann is bool or isinstance(v, bool):  # YAML true/false: only a bool field takes it, and only it
        return v if ann is bool and isinstance(v, bool) else _FAIL
    if ann is int:
        return v if isinstance(v, int) else _FAIL
    if ann is float:
        if isinstance(v, (int, float)):
            return float(v)
        if isinstance(v, str) and lenient:  # PyYAML (YAML 1.1) reads 3e-4 as a string: accept what float() reads
            try:
                return float(v)
            except ValueError:
                return _FAIL
        return _FAIL
    if ann is str:
        return v if isinstance(v, str) else _FAIL
    raise TypeError(f"unsupported config annotation {ann!r}")


def _hint(value: Any, ann: Any) -> str:
    choices = _literal_choices(ann)
    if choices and isinstance(value, str):
        near = closest(value, choices)
        return f"; did you mean {near!r}?" if near else ""
    if isinstance(value, (bool, int, float)) and "str" in type_name(ann):
        return f"; quote it to pass a string: '\"{value}\"'"
    return ""


def show(value: Any) -> str:
    """A value as the user wrote it in YAML: true/false/null, quoted strings."""
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    return repr(value)


def _kind(value: Any) -> str:
    return {dict: "mapping", list: "list", type(None): "null"}.get(type(value), type(value).__name__)


def _literal_choices(ann: Any) -> list[str]:
    if get_origin(ann) is Literal:
        return list(get_args(ann))
    if get_origin(ann) in (Union, types.UnionType):
        return [c for a in get_args(ann) for c in _literal_choices(a)]
    return []


def coerce(value: Any, ann: Any, key: str) -> Any:
    """Return value converted to the annotation (int -> float, numeric str -> float) or raise ConfigError."""
    out = _coerce(value, ann)
    if out is _FAIL:
        got = "" if isinstance(value, str) and _literal_choices(ann) else f", got {_kind(value)}"
        raise ConfigError(f"{key}={show(value)}: expected {type_name(ann)}{got}{_hint(value, ann)}")
    return out


def matches(value: Any, ann: Any) -> bool:
    """Strict check: the value already has the annotated type (an int is accepted where a float is)."""
    return _coerce(value, ann, lenient=False) is not _FAIL
