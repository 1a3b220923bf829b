"""Tokenize JSONL or text files into a megatron-core indexed dataset (.bin/.idx); see megatron_upipe/data/preprocess.py.

One document per JSONL line (its `--json-key` field) or per plain-text file, each kept whole with an end-of-document
token appended. Writes `<output-prefix>_<json-key>_document.{bin,idx}`; pass that prefix as the data path.

    .venv/bin/python tools/preprocess_data.py --input data/corpus --tokenizer data/tokenizer/spm.model \\
        --output-prefix data/corpus --workers 2

Bad input (a missing file, a tokenizer that does not load, a line without --json-key, text that is not UTF-8) ends
in one line naming it, exit 2, and leaves no half-written dataset.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_upipe.cli import ArgumentParser, fail, positive_int  # noqa: E402
from megatron_upipe.data.documents import expand_inputs  # noqa: E402
from megatron_upipe.data.preprocess import PreprocessConfig, preprocess  # noqa: E402
from megatron_upipe.data.tokenizers import build_tokenizer  # noqa: E402

PROG = "preprocess_data.py"


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help="*.jsonl / text files, or directories of them")
    p.add_argument("--tokenizer", required=True, help="sentencepiece .model, tokenizer.json, or a directory with one")
    p.add_argument("--output-prefix", type=Path, required=True)
    p.add_argument("--json-key", default="text", help="the JSONL field holding a document's text (default: text)")
    p.add_argument("--workers", type=positive_int, default=1)
    p.add_argument("--chunk-size", type=positive_int, default=PreprocessConfig.chunk_size,
                   help="documents per worker task")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)

    try:
        inputs = tuple(expand_inputs(args.input))
    except FileNotFoundError as e:
        return fail(PROG, f"--input: {e}")
    try:
        build_tokenizer(args.tokenizer)  # preprocess loads it again; refused here under its option's name
    except (OSError, ValueError) as e:
        return fail(PROG, f"--tokenizer {args.tokenizer}: {' '.join(str(e).split())}")

    t0 = time.perf_counter()
    try:
        stats = preprocess(PreprocessConfig(
            inputs=inputs, output_prefix=args.output_prefix, tokenizer=args.tokenizer, json_key=args.json_key,
            workers=args.workers, chunk_size=args.chunk_size, progress=not args.no_progress,
        ))
    except ValueError as e:  # a line that is not JSON or lacks --json-key, a file that is not UTF-8
        return fail(PROG, e)
    except OSError as e:  # an input that cannot be read, an --output-prefix that cannot be written
        return fail(PROG, f"{e.filename}: {e.strerror} (check --input and --output-prefix)")
    print(f"{stats.dataset_prefix}.{{bin,idx}}: {stats.documents} documents, {stats.tokens} tokens "
          f"({stats.skipped} empty skipped) in {time.perf_counter() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    from megatron_upipe.console import quiet_third_party

    quiet_third_party(cuda=False, tool=True)  # known-harmless notices; megatron-core is imported in main()
    sys.exit(main())
