"""Reading documents from input files: what counts as one document.

  * `*.jsonl` / `*.json` (JSON Lines): one document per non-empty line, its text under `json_key`.
  * any other file (plain text, UTF-8): the whole file is one document. A book stays one document; megatron's
    GPTDataset packs and splits documents across fixed-length samples anyway, so nothing is gained by cutting it,
    and cutting at blank lines would put end-of-document tokens inside a text.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

JSONL_SUFFIXES = (".jsonl", ".json")


def is_jsonl(path: Path) -> bool:
    return path.suffix in JSONL_SUFFIXES


def read_documents(inputs: list[Path], json_key: str = "text") -> Iterator[str]:
    """Every document's text, in input order (files in the order given, lines in file order)."""
    for path in inputs:
        if not path.is_file():
            raise FileNotFoundError(f"input file not found: {path}")
        try:
            yield from _documents_of(path, json_key)
        except UnicodeDecodeError as exc:
            raise ValueError(f"{path}: not UTF-8 text ({exc.reason}): convert it to UTF-8") from exc


def _documents_of(path: Path, json_key: str) -> Iterator[str]:
    if not is_jsonl(path):
        yield path.read_text(encoding="utf-8")
        return
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({exc})") from exc
            if not isinstance(obj, dict) or not isinstance(obj.get(json_key), str):
                raise ValueError(f"{path}:{lineno}: no string field {json_key!r} (set --json-key)")
            yield obj[json_key]


def expand_inputs(patterns: list[str]) -> list[Path]:
    """Files named directly, plus the files (sorted) of any directory named; a stable order either way."""
    paths: list[Path] = []
    for pattern in patterns:
        p = Path(pattern)
        if p.is_dir():
            paths.extend(sorted(q for q in p.iterdir() if q.is_file() and not q.name.startswith(".")))
        elif p.exists():
            paths.append(p)
        else:
            raise FileNotFoundError(f"input not found: {p}")
    if not paths:
        raise FileNotFoundError(f"no input files in {patterns}")
    return paths
