"""Train the shipped sentencepiece tokenizer (lossless, deterministic BPE; see megatron_upipe/data/tokenizer_training.py).

    .venv/bin/python tools/train_tokenizer.py --input data/corpus --model-prefix data/tokenizer/spm --vocab-size 4096

Bad input (a missing file, a --vocab-size the corpus cannot fill, text that is not UTF-8) ends in one line, exit 2.
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
from megatron_upipe.data.tokenizer_training import SentencePieceTrainingConfig, train_sentencepiece  # noqa: E402
from megatron_upipe.data.tokenizers import build_tokenizer  # noqa: E402

PROG = "train_tokenizer.py"


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help="JSONL/text files, or directories of them")
    p.add_argument("--model-prefix", type=Path, required=True, help="writes PREFIX.model")
    p.add_argument("--vocab-size", type=positive_int, default=SentencePieceTrainingConfig.vocab_size)
    p.add_argument("--model-type", choices=["bpe", "unigram"], default=SentencePieceTrainingConfig.model_type)
    p.add_argument("--json-key", default="text")
    args = p.parse_args(argv)

    try:
        inputs = expand_inputs(args.input)
    except FileNotFoundError as e:
        return fail(PROG, f"--input: {e}")
    try:
        config = SentencePieceTrainingConfig(vocab_size=args.vocab_size, model_type=args.model_type)
    except ValueError as e:
        return fail(PROG, f"--vocab-size {args.vocab_size}: {e}")

    t0 = time.perf_counter()
    try:
        model = train_sentencepiece(inputs, args.model_prefix, config, args.json_key)
    except ValueError as e:  # a line that is not JSON or lacks --json-key, a file that is not UTF-8
        return fail(PROG, e)
    except RuntimeError as e:  # sentencepiece's trainer, e.g. "Vocabulary size too high (N). Please set it to ..."
        return fail(PROG, f"sentencepiece refused the training (--vocab-size {args.vocab_size}, --model-type "
                          f"{args.model_type}): {' '.join(str(e).split())}")
    except OSError as e:
        return fail(PROG, f"{e.filename}: {e.strerror} (check --input and --model-prefix)")
    tok = build_tokenizer(model)
    print(f"{model}: vocab_size={tok.vocab_size} eod={tok.eod} pad={tok.pad} "
          f"sha256={tok.fingerprint().sha256[:16]} in {time.perf_counter() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
