"""Tokenizers: one small interface, two file formats, and a fingerprint that checkpoints can compare.

`build_tokenizer(spec)` picks the implementation from the path alone:
  * a directory, or a file whose name ends in `.json`  -> `HFTokenizer` (a `tokenizers` tokenizer.json; in a
    directory, `tokenizer_config.json` beside it names the eos/pad tokens when present)
  * any other file (normally `*.model`)                -> `SentencePieceTokenizer`

A `Tokenizer` also carries what megatron-core's datasets read from their `tokenizer` (`vocab_size`, `eod`, `pad`,
`unique_identifiers`), so an instance is passed straight to `GPTDatasetConfig(tokenizer=...)`.
"""

from __future__ import annotations

import abc
import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

# End-of-document and padding tokens looked up, in this order, in a tokenizer.json without a tokenizer_config.json.
_EOD_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "[EOS]")
_PAD_NAMES = ("<pad>", "<|pad|>", "[PAD]", "<|finetune_right_pad_id|>")


@dataclass(frozen=True)
class TokenizerFingerprint:
    """What identifies a tokenizer: its kind, the sha256 of its model file, and the ids a model depends on."""

    kind: str
    sha256: str
    vocab_size: int
    eod: int
    pad: int

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TokenizerFingerprint":
        return cls(**d)

    def check_matches(self, other: "TokenizerFingerprint") -> None:
        """Raise ValueError naming every field that differs (e.g. a checkpoint saved with another tokenizer)."""
        diffs = [f"{k}: {v!r} != {getattr(other, k)!r}" for k, v in asdict(self).items() if getattr(other, k) != v]
        if diffs:
            raise ValueError("tokenizer does not match the expected one (" + "; ".join(diffs) + ")")


class Tokenizer(abc.ABC):
    """vocab_size, eod and pad ids, and text <-> ids. `eod` is appended after every document."""

    kind: str
    spec: Path  # what the tokenizer was built from (a file or a directory)
    path: Path  # the file whose bytes define the tokenizer
    vocab_size: int
    eod: int
    pad: int

    @abc.abstractmethod
    def tokenize(self, text: str) -> list[int]:
        """Token ids of `text`, with no special tokens added."""

    @abc.abstractmethod
    def detokenize(self, ids: list[int]) -> str: ...

    def fingerprint(self) -> TokenizerFingerprint:
        digest = hashlib.sha256(self.path.read_bytes()).hexdigest()
        return TokenizerFingerprint(self.kind, digest, self.vocab_size, self.eod, self.pad)

    @property
    def unique_identifiers(self) -> dict:
        """Read by megatron-core when hashing a dataset's cache key, so a new tokenizer never hits an old cache."""
        return {"class": type(self).__name__, **self.fingerprint().to_dict()}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r}, vocab_size={self.vocab_size}, eod={self.eod})"


def _require_file(path: Path, what: str) -> Path:
    if not path.exists():
        raise FileNotFoundError(f"{what} not found: {path}")
    if not path.is_file():
        raise FileNotFoundError(f"{what} is not a file: {path}")
    return path


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece `.model` file. eod is the model's eos id; pad is its pad id, or eod when it has none."""

    kind = "sentencepiece"

    def __init__(self, path: str | Path) -> None:
        import sentencepiece

        self.spec = Path(path)
        self.path = _require_file(Path(path), "sentencepiece model")
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=str(self.path))
        except Exception as exc:  # sentencepiece raises OSError/RuntimeError with a terse message
            raise ValueError(f"cannot load sentencepiece model {self.path}: {exc}") from exc
        self.vocab_size = self._sp.vocab_size()
        self.eod = self._sp.eos_id()
        if self.eod < 0:
            raise ValueError(f"sentencepiece model {self.path} has no eos piece to use as end-of-document")
        self.pad = self._sp.pad_id() if self._sp.pad_id() >= 0 else self.eod

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def detokenize(self, ids: list[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def __getstate__(self) -> dict:  # pickled as its path (for worker processes), reloaded on arrival
        return {"spec": self.spec}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["spec"])


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizers` tokenizer.json (or a directory holding one, plus an optional
    tokenizer_config.json naming `eos_token` / `pad_token`). pad falls back to eod when there is none."""

    kind = "hf-tokenizers"

    def __init__(self, path: str | Path) -> None:
        import tokenizers

        self.spec = path = Path(path)
        config: dict = {}
        if path.is_dir():
            config_path = path / "tokenizer_config.json"
            if config_path.is_file():
                config = json.loads(config_path.read_text(encoding="utf-8"))
            path = path / "tokenizer.json"
        self.path = _require_file(path, "tokenizer.json")
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(self.path))
        except Exception as exc:
            raise ValueError(f"cannot load HF tokenizer {self.path}: {exc}") from exc
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        eod = self._special_id(config.get("eos_token"), _EOD_NAMES)
        if eod is None:
            raise ValueError(
                f"HF tokenizer {self.path} has none of the end-of-document tokens {_EOD_NAMES}; "
                "put a tokenizer_config.json with an `eos_token` beside it"
            )
        self.eod = eod
        pad = self._special_id(config.get("pad_token"), _PAD_NAMES)
        self.pad = eod if pad is None else pad

    def _special_id(self, configured: str | dict | None, fallbacks: tuple[str, ...]) -> int | None:
        if isinstance(configured, dict):  # {"content": "</s>", ...} in older tokenizer_config.json files
            configured = configured.get("content")
        for name in ([configured] if configured else []) + list(fallbacks):
            token_id = self._tok.token_to_id(name)
            if token_id is not None:
                return token_id
        return None

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids: list[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def __getstate__(self) -> dict:
        return {"spec": self.spec}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["spec"])


def build_tokenizer(spec: str | Path) -> Tokenizer:
    """A tokenizer from a path: a directory or `*.json` -> HFTokenizer, any other file -> SentencePieceTokenizer."""
    path = Path(spec)
    if not path.exists():
        raise FileNotFoundError(f"tokenizer not found: {path} (expected a sentencepiece .model file, "
                                "a tokenizer.json, or a directory holding a tokenizer.json)")
    if path.is_dir() or path.suffix == ".json":
        return HFTokenizer(path)
    return SentencePieceTokenizer(path)
