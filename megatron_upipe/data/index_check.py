"""A cheap start-up check of a megatron-core indexed dataset `<prefix>.{bin,idx}`, read without torch or megatron-core.

megatron-core reads a broken pair only when the datasets are built, after the process groups and the model, and
then fails with something unrelated to the cause (an empty .bin: AttributeError '_MMapBinReader'; a truncated .idx:
`offset must be non-negative`; ids beyond the vocabulary: IndexError at step 1). `dataset_problem` reads the header
and a few entries instead (importing megatron-core's reader costs seconds and it checks its header with `assert`):

  .idx  b"MMIDIDX\\x00\\x00", version <Q> = 1, dtype code <B>, S = sequence count <Q>, D = document count <Q>,
        then int32 lengths [S], int64 byte pointers into the .bin [S], int64 document boundaries [D]
        (sequence indices, 0 first and S last: D - 1 documents); the layout of megatron-core's `_IndexWriter`
  .bin  the tokens of all sequences back to back, in the dtype of the code (`DType` of indexed_dataset.py)

Checked: the header, the .idx length against S and D, at least one document, the last sequence ending exactly at
the end of the .bin, the first and last documents lying inside it, and their token ids (at most `SAMPLE_TOKENS`
of each) inside the vocabulary. The reading cost does not grow with the dataset.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
HEADER_BYTES = 9 + 8 + 1 + 8 + 8
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}
SAMPLE_SEQUENCES = 16  # of the first and of the last document
SAMPLE_TOKENS = 1 << 20  # per sampled document


class IndexFileError(ValueError):
    """What is wrong with a .bin/.idx pair, naming the file (without the fix: the caller knows its setting)."""


@dataclass(frozen=True)
class IndexHeader:
    dtype: type[np.number]
    sequence_count: int
    document_count: int  # boundaries: document_count - 1 documents

    @property
    def index_bytes(self) -> int:
        return HEADER_BYTES + self.sequence_count * (4 + 8) + self.document_count * 8


def read_header(path: str, idx_path: str | None = None) -> IndexHeader:
    """The header of `path`, checked against the file's length; IndexFileError (naming the file `idx_path`, by
    default `path`) if it is not a usable index."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(HEADER_BYTES)
    idx_path = idx_path or path
    if size == 0:
        raise IndexFileError(f"{idx_path} is empty")
    if head[:9] != MAGIC:
        raise IndexFileError(f"{idx_path} is not a megatron-core index (it does not start with {MAGIC!r})")
    if size < HEADER_BYTES:
        raise IndexFileError(f"{idx_path} is {size} bytes, shorter than the {HEADER_BYTES}-byte header: truncated")
    version, code, sequences, documents = struct.unpack("<QBQQ", head[9:])
    if version != 1:
        raise IndexFileError(f"{idx_path} has index version {version}; megatron-core reads version 1")
    if code not in DTYPES:
        raise IndexFileError(f"{idx_path} has dtype code {code}, not one of megatron-core's ({min(DTYPES)}-"
                             f"{max(DTYPES)})")
    if not np.issubdtype(DTYPES[code], np.integer):
        raise IndexFileError(f"{idx_path} holds {DTYPES[code].__name__} values, not token ids")
    header = IndexHeader(DTYPES[code], sequences, documents)
    if size < header.index_bytes:
        raise IndexFileError(f"{idx_path} is {size} bytes but its header lists {sequences} sequences and {documents} "
                             f"document boundaries ({header.index_bytes} bytes): truncated")
    return header


def _read(f, name: str, offset: int, dtype, count: int) -> np.ndarray:
    f.seek(offset)
    data = f.read(count * np.dtype(dtype).itemsize)
    if len(data) < count * np.dtype(dtype).itemsize:
        raise IndexFileError(f"{name} ends before byte {offset + count * np.dtype(dtype).itemsize}: truncated")
    return np.frombuffer(data, dtype=dtype, count=count)


def dataset_problem(prefix: str, vocab_size: int | None) -> str | None:
    """What is wrong with `<prefix>.{bin,idx}` for a model of `vocab_size` ids (None: not checked), or None. The
    files are named without their directory (the caller names the prefix)."""
    try:
        _check(prefix, vocab_size)
    except IndexFileError as e:
        return str(e)
    except OSError as e:
        return f"{os.path.basename(e.filename or prefix)}: {e.strerror or e}"
    return None


def _check(prefix: str, vocab_size: int | None) -> None:
    idx, bin_ = f"{os.path.basename(prefix)}.idx", f"{os.path.basename(prefix)}.bin"  # as named in messages
    h = read_header(f"{prefix}.idx", idx)
    S, D = h.sequence_count, h.document_count
    if S == 0 or D < 2:
        raise IndexFileError(f"{idx} holds no documents ({S} sequences, {max(D - 1, 0)} documents)")
    lengths_at, pointers_at = HEADER_BYTES, HEADER_BYTES + 4 * S
    bounds_at = pointers_at + 8 * S
    itemsize = np.dtype(h.dtype).itemsize
    bin_bytes = os.path.getsize(f"{prefix}.bin")
    with open(f"{prefix}.idx", "rb") as f:
        first, last = _read(f, idx, bounds_at, np.int64, 2), _read(f, idx, bounds_at + 8 * (D - 2), np.int64, 2)
        if not (first[0] == 0 <= first[1] <= S and 0 <= last[0] <= last[1] == S):
            raise IndexFileError(f"{idx}: its document boundaries ({first[0]}, {first[1]} ... {last[0]}, {last[1]}) "
                                 f"do not run from 0 to its {S} sequences: corrupt")
        last_pointer = int(_read(f, idx, pointers_at + 8 * (S - 1), np.int64, 1)[0])
        end = last_pointer + int(_read(f, idx, lengths_at + 4 * (S - 1), np.int32, 1)[0]) * itemsize
        if bin_bytes == 0:
            raise IndexFileError(f"{bin_} is empty but {idx} lists {S} sequences")
        if end != bin_bytes:
            raise IndexFileError(f"{bin_} is {bin_bytes} bytes but {idx} ends its last sequence at byte {end}: "
                                 f"truncated, or the two files come from different runs")
        docs = {"first": (int(first[0]), int(first[1])), "last": (int(last[0]), int(last[1]))}
        spans = {}
        for which, (lo, hi) in docs.items():
            hi = min(hi, lo + SAMPLE_SEQUENCES)
            lengths = _read(f, idx, lengths_at + 4 * lo, np.int32, hi - lo)
            pointers = _read(f, idx, pointers_at + 8 * lo, np.int64, hi - lo)
            for i, (n, at) in enumerate(zip(lengths.tolist(), pointers.tolist()), start=lo):
                if n < 0 or at < 0 or at % itemsize or at + n * itemsize > bin_bytes:
                    raise IndexFileError(f"{idx}: sequence {i} ({n} tokens at byte {at}) lies outside {bin_} "
                                         f"({bin_bytes} bytes): corrupt")
            spans[which] = list(zip(lengths.tolist(), pointers.tolist()))
    if vocab_size is None:
        return
    with open(f"{prefix}.bin", "rb") as f:
        for which, seqs in spans.items():
            budget = SAMPLE_TOKENS
            for n, at in seqs:
                tokens = _read(f, bin_, at, h.dtype, min(n, budget))
                budget -= len(tokens)
                bad = tokens[(tokens < 0) | (tokens >= vocab_size)]
                if bad.size:
                    raise IndexFileError(f"{bin_} holds token id {int(bad[0])} (in its {which} document), outside "
                                         f"the vocabulary of {vocab_size} ids: written with another tokenizer, "
                                         f"or corrupt")
