"""Tokenize JSONL or text files into a megatron-core indexed dataset (.bin/.idx); see megatron_upipe/data/preprocess.py.

One document per JSONL line (its `--json-key` field) or per plain-text file, each kept whole with an end-of-document
token appended. Writes `<output-prefix>_<json-key>_document.{bin,idx}`; pass that prefix as the data path.

    .venv/bin/python tools/preprocess_data.py --input data/corpus --tokenizer data/tokenizer/spm.model \\
        --output-prefix data/corpus --workers 2
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from megatron_upipe.data.documents import expand_inputs
from megatron_upipe.data.preprocess import PreprocessConfig, preprocess


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help="*.jsonl / text files, or directories of them")
    p.add_argument("--tokenizer", required=True, help="sentencepiece .model, tokenizer.json, or a directory with one")
    p.add_argument("--output-prefix", type=Path, required=True)
    p.add_argument("--json-key", default="text", help="the JSONL field holding a document's text (default: text)")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--chunk-size", type=int, default=PreprocessConfig.chunk_size, help="documents per worker task")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args()

    t0 = time.perf_counter()
    stats = preprocess(PreprocessConfig(
        inputs=tuple(expand_inputs(args.input)), output_prefix=args.output_prefix, tokenizer=args.tokenizer,
        json_key=args.json_key, workers=args.workers, chunk_size=args.chunk_size, progress=not args.no_progress,
    ))
    print(f"{stats.dataset_prefix}.{{bin,idx}}: {stats.documents} documents, {stats.tokens} tokens "
          f"({stats.skipped} empty skipped) in {time.perf_counter() - t0:.1f}s")


if __name__ == "__main__":
    main()
