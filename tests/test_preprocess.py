"""Preprocessing: the written index holds exactly tokenize(doc) + [eod] per document, in input order, the same
bytes for any worker count, and the shipped index is what the shipped corpus and tokenizer give."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_upipe.data.documents import expand_inputs, read_documents
from megatron_upipe.data.preprocess import PreprocessConfig, preprocess
from megatron_upipe.data.tokenizers import build_tokenizer

REPO = Path(__file__).resolve().parents[1]
SPM = REPO / "data" / "tokenizer" / "spm.model"
SHIPPED_PREFIX = REPO / "data" / "corpus_text_document"


@pytest.fixture
def small_inputs(tmp_path) -> tuple[list[Path], list[str]]:
    """A JSONL file whose text is under "body" (one doc is whitespace only) and a plain-text file (one doc)."""
    docs = [d for _, d in zip(range(40), read_documents(sorted((REPO / "data" / "corpus").glob("*.jsonl"))))]
    jsonl = tmp_path / "a.jsonl"
    with jsonl.open("w") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"body": d, "id": i}) + "\n")
            if i == 5:
                f.write(json.dumps({"body": "  \n "}) + "\n\n")  # skipped; the blank line is no document
    book = tmp_path / "book.txt"
    book.write_text("A whole file is one document.\n\nEven with blank lines.\n")
    return [jsonl, book], docs + [book.read_text()]


def _read_index(prefix: Path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    return IndexedDataset(str(prefix))


def test_index_matches_direct_tokenization(small_inputs, tmp_path):
    inputs, docs = small_inputs
    stats = preprocess(PreprocessConfig(tuple(inputs), tmp_path / "out" / "small", str(SPM), json_key="body",
                                        progress=False))
    assert stats.dataset_prefix == tmp_path / "out" / "small_body_document"
    assert (stats.documents, stats.skipped) == (len(docs), 1)
    tok = build_tokenizer(SPM)
    index = _read_index(stats.dataset_prefix)
    assert len(index) == len(docs) and index.index.dtype == np.uint16
    assert list(index.document_indices) == list(range(len(docs) + 1))  # one sequence per document
    for i, doc in enumerate(docs):
        assert index[i].tolist() == tok.tokenize(doc) + [tok.eod]
    assert stats.tokens == int(index.sequence_lengths.sum())


def test_worker_count_does_not_change_the_bytes(small_inputs, tmp_path):
    inputs, _ = small_inputs
    outputs = []
    for workers, chunk_size in [(1, 64), (2, 3), (2, 1)]:
        stats = preprocess(PreprocessConfig(tuple(inputs), tmp_path / f"w{workers}c{chunk_size}" / "x",
                                            str(SPM), json_key="body", workers=workers, chunk_size=chunk_size,
                                            progress=False))
        outputs.append(tuple(Path(f"{stats.dataset_prefix}{ext}").read_bytes() for ext in (".bin", ".idx")))
    assert outputs[0] == outputs[1] == outputs[2]


def test_shipped_index_is_reproduced_by_the_cli(tmp_path, monkeypatch, capsys):
    argv = ["preprocess_data.py", "--input", str(REPO / "data" / "corpus"), "--tokenizer", str(SPM),
            "--output-prefix", str(tmp_path / "corpus"), "--workers", "2", "--no-progress"]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as done:  # the script ends in sys.exit(main())
        runpy.run_path(str(REPO / "tools" / "preprocess_data.py"), run_name="__main__")
    assert done.value.code == 0
    assert "1262 documents" in capsys.readouterr().out
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"corpus_text_document{ext}").read_bytes() == Path(f"{SHIPPED_PREFIX}{ext}").read_bytes()


def test_bad_inputs_are_reported_with_their_location(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"content": "wrong key"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: no string field 'text'"):
        list(read_documents([bad]))
    bad.write_text('{"text": "fine"}\n{oops\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        list(read_documents([bad]))
    with pytest.raises(FileNotFoundError, match="input not found"):
        expand_inputs([str(tmp_path / "missing.jsonl")])
    with pytest.raises(ValueError, match="workers"):
        PreprocessConfig((bad,), tmp_path / "x", str(SPM), workers=0)
