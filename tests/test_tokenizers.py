"""Tokenizers: the shipped sentencepiece model and an HF tokenizer.json, path dispatch, errors, fingerprints."""

from __future__ import annotations

import json
import pickle
import runpy
import shutil
import sys
from pathlib import Path

import pytest

from megatron_upipe.data.documents import read_documents
from megatron_upipe.data.tokenizer_training import SentencePieceTrainingConfig, train_sentencepiece
from megatron_upipe.data.tokenizers import (
    ByteTokenizer,
    HFTokenizer,
    SentencePieceTokenizer,
    TokenizerFingerprint,
    build_tokenizer,
)

REPO = Path(__file__).resolve().parents[1]
SPM = REPO / "data" / "tokenizer" / "spm.model"
CORPUS = sorted((REPO / "data" / "corpus").glob("*.jsonl"))
TRICKY = [
    "",
    "plain words",
    "  two leading spaces, trailing tab\t",
    "lines\n\n\nand  double  spaces\r\n",
    "café, naïve, Ωμέγα, 東京, emoji 🙂, zero-width\u200bjoiner",
    "digits 3.14159 and 2026-12-02",
]


def _train_hf_tokenizer(directory: Path, eos: str = "<|endoftext|>", extra_specials: tuple[str, ...] = ()) -> Path:
    """A small byte-level BPE tokenizer.json trained on a slice of the shipped corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = [eos, *extra_specials] if eos else list(extra_specials)
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    docs = [d for _, d in zip(range(200), read_documents(CORPUS))]
    tok.train_from_iterator(docs, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    return directory / "tokenizer.json"


def test_shipped_sentencepiece_model_is_lossless():
    tok = build_tokenizer(SPM)
    assert isinstance(tok, SentencePieceTokenizer)
    assert (tok.vocab_size, tok.eod, tok.pad) == (4096, 2, 3)
    docs = list(read_documents(CORPUS))
    assert len(docs) == 1262
    for text in docs[::10] + TRICKY:
        ids = tok.tokenize(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.eod not in ids and tok.pad not in ids  # specials never come from text
        assert tok.detokenize(ids) == text
    assert len(tok.tokenize(docs[0])) < len(docs[0]) / 3  # it compresses English text (~4 chars per token)


def test_hf_tokenizer_file_and_directory(tmp_path):
    path = _train_hf_tokenizer(tmp_path / "hf", extra_specials=("<pad>",))
    for spec in (path, path.parent, str(path)):
        tok = build_tokenizer(spec)
        assert isinstance(tok, HFTokenizer)
        assert tok.eod == tok._tok.token_to_id("<|endoftext|>")
        assert tok.pad == tok._tok.token_to_id("<pad>") != tok.eod
        assert tok.vocab_size == 600
        for text in TRICKY + [next(read_documents(CORPUS))]:
            ids = tok.tokenize(text)
            assert tok.eod not in ids
            assert tok.detokenize(ids) == text


def test_hf_tokenizer_config_names_eos_and_pad(tmp_path):
    path = _train_hf_tokenizer(tmp_path, eos="", extra_specials=("<my_eos>", "<my_pad>"))
    with pytest.raises(ValueError, match="end-of-document"):
        build_tokenizer(path)  # no known eod name and no config
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": {"content": "<my_eos>"}, "pad_token": "<my_pad>"}))
    tok = build_tokenizer(tmp_path)
    assert (tok.eod, tok.pad) == (tok._tok.token_to_id("<my_eos>"), tok._tok.token_to_id("<my_pad>"))
    with pytest.raises(ValueError, match="end-of-document"):  # the config is read only when given the directory
        HFTokenizer(path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<my_eos>"}))
    tok = build_tokenizer(tmp_path)
    assert tok.pad == tok.eod == tok._tok.token_to_id("<my_eos>")  # no pad token: pad falls back to eod


def test_byte_tokenizer():
    tok = ByteTokenizer(vocab_size=512)
    assert (tok.vocab_size, tok.eod, tok.pad) == (512, 256, 257)
    for text in TRICKY:
        assert tok.detokenize(tok.tokenize(text)) == text
    assert tok.tokenize("é") == [0xC3, 0xA9]
    assert tok.fingerprint() != ByteTokenizer(vocab_size=1024).fingerprint()
    assert pickle.loads(pickle.dumps(tok)).fingerprint() == tok.fingerprint()
    with pytest.raises(ValueError, match="258"):
        ByteTokenizer(vocab_size=200)


def test_clear_errors_for_missing_or_unreadable_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer not found"):
        build_tokenizer(tmp_path / "nope.model")
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        build_tokenizer(tmp_path / "empty_dir")
    (tmp_path / "bad.model").write_bytes(b"not a sentencepiece model")
    with pytest.raises(ValueError, match="cannot load sentencepiece model"):
        build_tokenizer(tmp_path / "bad.model")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot load HF tokenizer"):
        build_tokenizer(tmp_path / "bad.json")


def test_fingerprint_is_stable_and_tells_tokenizers_apart(tmp_path):
    a = build_tokenizer(SPM).fingerprint()
    shutil.copy(SPM, tmp_path / "copy.model")
    assert build_tokenizer(tmp_path / "copy.model").fingerprint() == a == build_tokenizer(SPM).fingerprint()
    assert TokenizerFingerprint.from_dict(json.loads(json.dumps(a.to_dict()))) == a
    assert a.kind == "sentencepiece" and len(a.sha256) == 64 and a.vocab_size == 4096
    a.check_matches(a)

    small = train_sentencepiece(CORPUS[:1], tmp_path / "small", SentencePieceTrainingConfig(vocab_size=512))
    b = build_tokenizer(small).fingerprint()
    assert b != a
    with pytest.raises(ValueError, match=r"sha256.*vocab_size: 4096 != 512"):
        a.check_matches(b)
    hf = build_tokenizer(_train_hf_tokenizer(tmp_path / "hf")).fingerprint()
    with pytest.raises(ValueError, match="kind"):
        a.check_matches(hf)


def test_tokenizers_pickle_by_path(tmp_path):
    for tok in (build_tokenizer(SPM), build_tokenizer(_train_hf_tokenizer(tmp_path / "hf"))):
        clone = pickle.loads(pickle.dumps(tok))
        assert type(clone) is type(tok) and clone.fingerprint() == tok.fingerprint()
        assert clone.tokenize("The Devil's Dictionary") == tok.tokenize("The Devil's Dictionary")


def test_training_is_deterministic_and_reproduces_the_shipped_model(tmp_path):
    config = SentencePieceTrainingConfig(vocab_size=4096)
    first = train_sentencepiece(CORPUS, tmp_path / "a" / "spm", config)
    second = train_sentencepiece(CORPUS, tmp_path / "b" / "other_name", config)
    assert first.read_bytes() == second.read_bytes() == SPM.read_bytes()
    with pytest.raises(ValueError, match="vocab_size"):
        SentencePieceTrainingConfig(vocab_size=100)


def test_train_tokenizer_cli(tmp_path, monkeypatch, capsys):
    argv = ["train_tokenizer.py", "--input", str(REPO / "data" / "corpus"), "--model-prefix", str(tmp_path / "spm")]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as done:  # the script ends in sys.exit(main())
        runpy.run_path(str(REPO / "tools" / "train_tokenizer.py"), run_name="__main__")
    assert done.value.code == 0
    assert "vocab_size=4096 eod=2 pad=3" in capsys.readouterr().out
    assert (tmp_path / "spm.model").read_bytes() == SPM.read_bytes()
