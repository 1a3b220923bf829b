"""Build a Config from dataclass defaults < a YAML file < `section.key=value` overrides.

Values are read with YAML scalar rules (`train.lr=3e-4`, `checkpoint.dir=null`, `data.split=[98,2,0]`) and
checked against the dataclass field types. An unknown key, in the file or on the command line, is an error that
names the closest known key. All problems found are reported together.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, get_type_hints

import yaml

from .fieldtypes import ConfigError, closest, coerce
from .schema import SECTIONS, Config


def known_keys() -> list[str]:
    return [f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)]


def _unknown(key: str, origin: str) -> str:
    near = closest(key, known_keys())
    if near:
        return f"unknown config key {key!r} ({origin}); did you mean {near!r}?"
    section = key.split(".")[0]
    if section in SECTIONS:
        keys = [k for k in known_keys() if k.startswith(section + ".")]
        return f"unknown config key {key!r} ({origin}); keys of {section}: {keys}"
    return f"unknown config key {key!r} ({origin}); sections are {list(SECTIONS)}"


def _read_yaml(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {e}") from None
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections ({list(SECTIONS)})")
    return doc


def parse_override(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {text!r} is not of the form section.key=value (e.g. parallel.cp=8)")
    try:
        return key.strip(), yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"override {text!r}: the value is not a YAML scalar/list: {e}") from None


def load_config(path: str | None = None, overrides: Sequence[str] = ()) -> Config:
    """The resolved config; raises ConfigError listing every unknown key, type error and rule violation."""
    values: dict[str, Any] = {}  # dotted key -> value, later sources win
    origin: dict[str, str] = {}
    problems: list[str] = []
    if path is not None:
        for section, body in _read_yaml(path).items():
            if body is None:
                continue
            if not isinstance(body, dict):
                problems.append(f"{path}: section {section!r} must be a mapping of keys, got {body!r}")
                continue
            for key, value in body.items():
                values[f"{section}.{key}"], origin[f"{section}.{key}"] = value, f"in {path}"
    for text in overrides:
        key, value = parse_override(text)
        values[key], origin[key] = value, "on the command line"
    known = set(known_keys())
    problems += [_unknown(k, origin[k]) for k in values if k not in known]

    sections = {}
    for name, cls in SECTIONS.items():
        hints = get_type_hints(cls)
        kwargs, type_errors = {}, len(problems)
        for f in dataclasses.fields(cls):
            key = f"{name}.{f.name}"
            if key in values:
                try:
                    kwargs[f.name] = coerce(values[key], hints[f.name], key)
                except ConfigError as e:
                    problems.append(f"{e} ({origin[key]})")
        if len(problems) > type_errors:
            continue  # the section's own rules would judge defaults standing in for the bad values
        try:
            sections[name] = cls(**kwargs)
        except ConfigError as e:
            problems.append(str(e))
    if problems:
        raise ConfigError("\n".join(problems))
    return Config(**sections)


def to_dict(config: Config) -> dict[str, dict[str, Any]]:
    return {name: dataclasses.asdict(getattr(config, name)) for name in SECTIONS}


class _Dumper(yaml.SafeDumper):
    """Block-style sections, flow-style lists (`split: [969.0, 30.0, 1.0]`)."""


_Dumper.add_representer(list, lambda dumper, v: dumper.represent_sequence("tag:yaml.org,2002:seq", v, flow_style=True))


def to_yaml(config: Config) -> str:
    """The resolved config as YAML that load_config reads back to an equal Config."""
    return yaml.dump(to_dict(config), Dumper=_Dumper, sort_keys=False, default_flow_style=False)
