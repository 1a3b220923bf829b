"""docs/config_reference.md is what tools/config_reference.py generates from the schema (so it cannot go stale),
and every config key has a description."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

from megatron_upipe.config import schema
from megatron_upipe.config.reference import all_docs, render_markdown, section_docs

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "docs" / "config_reference.md"


def _tool():
    spec = importlib.util.spec_from_file_location("config_reference", ROOT / "tools" / "config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_field_of_every_section_is_described():
    docs = all_docs()
    keys = [d.key for section in docs.values() for d in section]
    expected = [f"{name}.{f.name}" for name, cls in schema.SECTIONS.items() for f in dataclasses.fields(cls)]
    assert keys == expected and len(keys) > 60
    missing = [d.key for section in docs.values() for d in section if not d.help]
    assert not missing, f"add a comment above these fields in megatron_upipe/config/schema.py: {missing}"


def test_committed_reference_equals_the_generated_one():
    assert COMMITTED.read_text() == render_markdown(), "docs/config_reference.md is stale: python tools/config_reference.py"
    assert _tool().main(["--check", "--out", str(COMMITTED)]) == 0


def test_descriptions_come_from_comments_above_and_beside_and_from_metadata():
    d = {k.key: k for k in section_docs("memory", schema.MemoryConfig)}
    assert d["memory.mlp_chunks"].help.startswith("Sequence tiles of every layer's SwiGLU MLP, each tile's")  # above
    assert d["memory.mlp_chunks"].help.endswith("(tiles differ by at most one token). 1 = off.")
    assert d["memory.recompute"].help == "megatron-core activation recompute granularity"  # beside
    assert (d["memory.recompute"].type, d["memory.recompute"].default) == ("one of none|selective|full", "none")
    c = {k.key: k for k in section_docs("checkpoint", schema.CheckpointConfig)}
    assert (c["checkpoint.keep_last"].type, c["checkpoint.keep_last"].default) == ("int or null", "null")

    @dataclasses.dataclass(frozen=True)
    class Probe:
        x: int = dataclasses.field(default=3, metadata={"help": "from metadata"})

    assert section_docs("p", Probe)[0] == type(section_docs("p", Probe)[0])("p.x", "int", "3", "from metadata")


def test_check_refuses_a_stale_file(tmp_path, capsys):
    stale = tmp_path / "ref.md"
    stale.write_text(render_markdown().replace("| `train.lr` |", "| `train.learning_rate` |"))
    assert _tool().main(["--check", "--out", str(stale)]) == 1
    assert "is stale" in capsys.readouterr().err
    assert _tool().main(["--out", str(stale)]) == 0 and stale.read_text() == render_markdown()
