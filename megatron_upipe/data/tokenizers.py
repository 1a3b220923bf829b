"""Tokenizers: one small interface, two file formats, and a fingerprint that checkpoints can compare.

`build_tokenizer(spec)` picks the implementation from the path alone:
  * a directory, or a file whose name ends in `.json`  -> `HFTokenizer` (a `tokenizers` tokenizer.json; in a
    directory, `tokenizer_config.json` beside it names the eos/pad tokens when present)
  * any other file (normally `*.model`)                -> `SentencePieceTokenizer`
`ByteTokenizer(vocab_size)` needs no file: UTF-8 bytes, for mock data (whose only need is a vocabulary size).

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
    """vocab_size, eod and pad ids, and text <-> ids. `eod` is appended after every document.

    `spec` is what it was built from (pickling sends only that); `sha256` hashes the model bytes actually loaded."""

    kind: str
    spec: str | Path | None
    sha256: str
    vocab_size: int
    eod: int
    pad: int

    @abc.abstractmethod
    def tokenize(self, text: str) -> list[int]:
        """Token ids of `text`, with no special tokens added."""

    @abc.abstractmethod
    def detokenize(self, ids: list[int]) -> str: ...

    def fingerprint(self) -> TokenizerFingerprint:
        return TokenizerFingerprint(self.kind, self.sha256, self.vocab_size, self.eod, self.pad)

    @property
    def unique_identifiers(self) -> dict:
        """Read by megatron-core when hashing a dataset's cache key, so a new tokenizer never hits an old cache."""
        return {"class": type(self).__name__, **self.fingerprint().to_dict()}

    def __getstate__(self) -> dict:  # pickled as its spec (for worker processes), rebuilt on arrival
        return {"spec": self.spec}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["spec"])

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.spec)!r}, vocab_size={self.vocab_size}, eod={self.eod})"


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

        self.spec = path = _require_file(Path(path), "sentencepiece model")
        model = path.read_bytes()
        self.sha256 = hashlib.sha256(model).hexdigest()
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_proto=model)
        except Exception as exc:  # sentencepiece raises OSError/RuntimeError with a terse message
            raise ValueError(f"cannot load sentencepiece model {path}: {exc}") from exc
        self.vocab_size = self._sp.vocab_size()
        self.eod = self._sp.eos_id()
        if self.eod < 0:
            raise ValueError(f"sentencepiece model {path} has no eos piece to use as end-of-document")
        self.pad = self._sp.pad_id() if self._sp.pad_id() >= 0 else self.eod

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def detokenize(self, ids: list[int]) -> str:
        return self._sp.decode([int(i) for i in ids])


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
        path = _require_file(path, "tokenizer.json")
        model = path.read_bytes()
        self.sha256 = hashlib.sha256(model).hexdigest()
        try:
            self._tok = tokenizers.Tokenizer.from_str(model.decode("utf-8"))
        except Exception as exc:
            raise ValueError(f"cannot load HF tokenizer {path}: {exc}") from exc
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        eod = self._special_id(config.get("eos_token"), _EOD_NAMES)
        if eod is None:
            raise ValueError(
                f"HF tokenizer {path} has none of the end-of-document tokens {_EOD_NAMES}; "
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


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0-255, eod 256, pad 257; no file. For mock data and tests, where the model's vocabulary
    size is all that matters: `vocab_size` is the given size (at least 258), ids above 257 never occur."""

    kind = "bytes"

    def __init__(self, vocab_size: int = 258) -> None:
        if vocab_size < 258:
            raise ValueError(f"vocab_size={vocab_size}: a byte tokenizer needs at least 258 ids (256 bytes, eod, pad)")
        self.spec = vocab_size
        self.sha256 = hashlib.sha256(b"utf-8 bytes, eod 256, pad 257").hexdigest()
        self.vocab_size, self.eod, self.pad = vocab_size, 256, 257

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids: list[int]) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


def build_tokenizer(spec: str | Path) -> Tokenizer:
    """A tokenizer from a path: a directory or `*.json` -> HFTokenizer, any other file -> SentencePieceTokenizer."""
    path = Path(spec)
    if not path.exists():
        raise FileNotFoundError(f"tokenizer not found: {path} (expected a sentencepiece .model file, "
                                "a tokenizer.json, or a directory holding a tokenizer.json)")
    if path.is_dir() or path.suffix == ".json":
        return HFTokenizer(path)
    return SentencePieceTokenizer(path)
