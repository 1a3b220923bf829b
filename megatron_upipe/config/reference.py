"""The reference of every config key, read from the schema itself (tools/config_reference.py writes it to
docs/config_reference.md; a test keeps the committed file equal to what this module generates).

A field's description is its `metadata={"help": ...}` when it has one, else its comments in schema.py: the block
of `#` lines directly above it plus the comment at the end of its line(s), joined. Type and default come from the
dataclass. Nothing here is a hand-written list, so a field added to a section appears as soon as it exists.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import json
import sys
import tokenize
from dataclasses import dataclass
from typing import get_type_hints

from . import schema
from .fieldtypes import show, type_name


@dataclass(frozen=True)
class KeyDoc:
    key: str  # section.name
    type: str
    default: str
    help: str  # "" when the field has neither metadata nor comments


def _comments(source: str) -> dict[int, str]:
    """Line number -> the text of the comment on that line (without '#')."""
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string.lstrip("#").strip()
    return out


def _field_comments(cls: type) -> dict[str, str]:
    """Field name -> the comments that describe it in the class's source."""
    source = inspect.getsource(sys.modules[cls.__module__])
    lines = source.splitlines()
    comments = _comments(source)
    node = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    out = {}
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        above, n = [], stmt.lineno - 1
        while n >= 1 and lines[n - 1].strip().startswith("#"):
            above.insert(0, comments[n])
            n -= 1
        inline = [comments[i] for i in range(stmt.lineno, stmt.end_lineno + 1) if i in comments]
        out[stmt.target.id] = " ".join(part for part in (*above, *inline) if part)
    return out


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "(required)"
    if isinstance(value, list):
        return json.dumps(value)
    return show(value) if isinstance(value, (bool, type(None))) else str(value)


def section_docs(name: str, cls: type) -> list[KeyDoc]:
    hints = get_type_hints(cls)
    comments = _field_comments(cls)
    return [KeyDoc(f"{name}.{f.name}", type_name(hints[f.name]), _default(f),
                   f.metadata.get("help", "") or comments.get(f.name, ""))
            for f in dataclasses.fields(cls)]


def all_docs() -> dict[str, list[KeyDoc]]:
    return {name: section_docs(name, cls) for name, cls in schema.SECTIONS.items()}


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_markdown() -> str:
    out = ["# Config reference", "",
           "Every key of `pretrain_llama.py`'s config: `section.key` in a YAML file (`section:` then `key: value`) or",
           "as a `section.key=value` override. Defaults < YAML file < overrides; an unknown key is an error.",
           "Generated from `megatron_upipe/config/schema.py` by `python tools/config_reference.py` (do not edit;",
           "tests/test_config_reference.py fails when this file is stale). Cross-section rules (world size, heads",
           "vs tp/cp, batch divisibility) are checked by `megatron_upipe/config/validate.py`; run",
           "`pretrain_llama.py --config FILE --dry-run --world-size N` to check a config.", ""]
    for section, docs in all_docs().items():
        out += [f"## {section}", "", "| key | type | default | meaning |", "|---|---|---|---|"]
        out += [f"| `{d.key}` | {_cell(d.type)} | `{_cell(d.default)}` | {_cell(d.help)} |" for d in docs]
        out.append("")
    return "\n".join(out)
