"""Input files -> a megatron-core indexed dataset `<output_prefix>_<json_key>_document.{bin,idx}`.

Each document (see `documents.py`) is tokenized, an end-of-document token is appended, and it is written whole as
one sequence (and one document) of the index, however long: megatron's GPTDataset concatenates documents and cuts
fixed-length samples across them itself, so cutting long documents here would only lose context. Sentence
splitting (Megatron-LM's `--split-sentences`) is deliberately not offered: it only matters for BERT-style data.

Workers: documents are grouped in chunks of `chunk_size`, a `multiprocessing.Pool` tokenizes them with
`imap` (which keeps the input order), and the parent alone writes, so the output bytes do not depend on the
worker count. Whitespace-only documents are skipped (counted in `PreprocessStats.skipped`); an input without any
other document is a ValueError and writes nothing.
"""

from __future__ import annotations

import itertools
import multiprocessing
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from megatron_upipe.data.documents import read_documents
from megatron_upipe.data.tokenizers import Tokenizer, build_tokenizer


@dataclass(frozen=True)
class PreprocessConfig:
    inputs: tuple[Path, ...]
    output_prefix: Path
    tokenizer: str  # a build_tokenizer spec: sentencepiece .model, tokenizer.json, or a directory
    json_key: str = "text"
    workers: int = 1
    chunk_size: int = 64  # documents per worker task
    progress: bool = True

    def __post_init__(self) -> None:
        if not self.inputs:
            raise ValueError("no input files")
        if self.workers < 1:
            raise ValueError(f"workers={self.workers} must be >= 1")
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size={self.chunk_size} must be >= 1")

    @property
    def dataset_prefix(self) -> Path:
        """The prefix to pass as a data path: `<output_prefix>_<json_key>_document` (Megatron-LM's naming)."""
        return self.output_prefix.with_name(f"{self.output_prefix.name}_{self.json_key}_document")


@dataclass(frozen=True)
class PreprocessStats:
    dataset_prefix: Path
    documents: int  # written, each ending in eod
    tokens: int  # including the eod tokens
    skipped: int  # whitespace-only documents


class _ChunkEncoder:
    """Tokenizes a chunk of documents; pickled into each worker once (Pool initializer), not once per task."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def __call__(self, docs: list[str]) -> list[list[int] | None]:
        return [self.tokenizer.tokenize(d) + [self.tokenizer.eod] if d.strip() else None for d in docs]


_worker_encoder: _ChunkEncoder | None = None  # one per worker process, set by the Pool initializer


def _init_worker(encoder: _ChunkEncoder) -> None:
    global _worker_encoder
    _worker_encoder = encoder


def _encode_in_worker(docs: list[str]) -> list[list[int] | None]:
    assert _worker_encoder is not None, "worker started without _init_worker"
    return _worker_encoder(docs)


def _chunks(docs: Iterable[str], size: int) -> Iterator[list[str]]:
    it = iter(docs)
    while chunk := list(itertools.islice(it, size)):
        yield chunk


def preprocess(config: PreprocessConfig) -> PreprocessStats:
    """Tokenize every input document and write the .bin/.idx pair; returns what was written."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
    from tqdm import tqdm

    tokenizer = build_tokenizer(config.tokenizer)
    encoder = _ChunkEncoder(tokenizer)
    prefix = config.dataset_prefix
    prefix.parent.mkdir(parents=True, exist_ok=True)
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    chunks = _chunks(read_documents(list(config.inputs), config.json_key), config.chunk_size)

    documents = tokens = skipped = 0
    partial = Path(f"{prefix}.bin.partial")  # renamed over <prefix>.bin/.idx only once complete
    builder = IndexedDatasetBuilder(str(partial), dtype=dtype)
    with tqdm(unit="doc", desc=f"tokenizing -> {prefix.name}", disable=not config.progress) as bar:
        pool = (multiprocessing.get_context("spawn").Pool(config.workers, _init_worker, (encoder,))
                if config.workers > 1 else None)
        try:
            encoded_chunks = pool.imap(_encode_in_worker, chunks) if pool else map(encoder, chunks)
            for encoded in encoded_chunks:
                for ids in encoded:
                    if ids is None:
                        skipped += 1
                        continue
                    builder.add_document(np.asarray(ids, dtype=dtype), [len(ids)])
                    documents += 1
                    tokens += len(ids)
                bar.update(len(encoded))
            if not documents:  # megatron-core would read an index without documents only at training time, and fail
                raise ValueError(f"no documents in the input ({skipped} whitespace-only skipped): nothing written; "
                                 f"check --input and --json-key")
        except BaseException:
            partial.unlink(missing_ok=True)  # a failed run leaves no half-written dataset (nor an old .idx beside it)
            raise
        finally:
            if pool:
                pool.close()
                pool.join()
    builder.finalize(f"{prefix}.idx.partial")
    Path(f"{prefix}.idx.partial").replace(f"{prefix}.idx")
    partial.replace(f"{prefix}.bin")
    return PreprocessStats(prefix, documents, tokens, skipped)
