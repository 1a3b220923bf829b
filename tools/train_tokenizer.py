"""Train the shipped sentencepiece tokenizer (lossless, deterministic BPE; see megatron_upipe/data/tokenizer_training.py).

    .venv/bin/python tools/train_tokenizer.py --input data/corpus --model-prefix data/tokenizer/spm --vocab-size 4096
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from megatron_upipe.data.documents import expand_inputs
from megatron_upipe.data.tokenizer_training import SentencePieceTrainingConfig, train_sentencepiece
from megatron_upipe.data.tokenizers import build_tokenizer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help="JSONL/text files, or directories of them")
    p.add_argument("--model-prefix", type=Path, required=True, help="writes PREFIX.model")
    p.add_argument("--vocab-size", type=int, default=SentencePieceTrainingConfig.vocab_size)
    p.add_argument("--model-type", choices=["bpe", "unigram"], default=SentencePieceTrainingConfig.model_type)
    p.add_argument("--json-key", default="text")
    args = p.parse_args()

    t0 = time.perf_counter()
    config = SentencePieceTrainingConfig(vocab_size=args.vocab_size, model_type=args.model_type)
    model = train_sentencepiece(expand_inputs(args.input), args.model_prefix, config, args.json_key)
    tok = build_tokenizer(model)
    print(f"{model}: vocab_size={tok.vocab_size} eod={tok.eod} pad={tok.pad} "
          f"sha256={tok.fingerprint().sha256[:16]} in {time.perf_counter() - t0:.1f}s")


if __name__ == "__main__":
    main()
