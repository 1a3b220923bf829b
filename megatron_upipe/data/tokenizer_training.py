"""Train a small, lossless, deterministic sentencepiece BPE model from JSONL or text files.

Lossless: identity normalisation, whitespace kept as is, no dummy prefix, and byte fallback, so
`detokenize(tokenize(text)) == text` for any UTF-8 text. Deterministic: one trainer thread and no sentence
sampling, so the same input files give the same model bytes (and so the same fingerprint).
Ids: 0 <unk>, 1 <s>, 2 </s> (end of document), 3 <pad>.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

from megatron_upipe.data.documents import read_documents


@dataclass(frozen=True)
class SentencePieceTrainingConfig:
    vocab_size: int = 4096
    model_type: str = "bpe"
    character_coverage: float = 1.0
    max_sentence_length: int = 1 << 20  # documents are trained on whole, not cut into sentences

    def __post_init__(self) -> None:
        if self.vocab_size < 260 + 4:
            raise ValueError(f"vocab_size={self.vocab_size} leaves no room beyond the 256 byte pieces and 4 specials")
        if self.model_type not in ("bpe", "unigram"):
            raise ValueError(f"model_type={self.model_type!r}: use 'bpe' or 'unigram'")


def train_sentencepiece(
    inputs: list[Path], model_prefix: Path, config: SentencePieceTrainingConfig, json_key: str = "text"
) -> Path:
    """Train on the documents of `inputs` (read as in preprocessing); writes `<model_prefix>.model` and returns it.

    The model is written through `model_writer`, so its bytes do not record the output path."""
    import sentencepiece

    model_prefix.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    input_errors: list[Exception] = []

    def sentences():  # an input error is raised as itself, not inside sentencepiece's RuntimeError
        try:
            yield from (doc for doc in read_documents(inputs, json_key) if doc.strip())
        except (OSError, ValueError) as exc:
            input_errors.append(exc)

    try:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=sentences(),
            model_writer=buffer,
            vocab_size=config.vocab_size,
            model_type=config.model_type,
            character_coverage=config.character_coverage,
            max_sentence_length=config.max_sentence_length,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            byte_fallback=True,
            unk_id=0, bos_id=1, eos_id=2, pad_id=3,
            num_threads=1,
            input_sentence_size=0,  # use every document, no random sampling
            shuffle_input_sentence=False,
            minloglevel=2,
        )
    except RuntimeError:
        if input_errors:
            raise input_errors[0] from None
        raise
    if input_errors:
        raise input_errors[0]
    model_path = model_prefix.with_name(model_prefix.name + ".model")
    model_path.write_bytes(buffer.getvalue())
    return model_path
