"""HF model directories on disk: read weights lazily, write safetensors, carry the tokenizer files along.

Reading (`HFWeights`): model.safetensors.index.json (sharded), model.safetensors, pytorch_model.bin.index.json or
pytorch_model.bin, in this order of preference; safetensors are read one tensor at a time on access (`safe_open`,
memory-mapped), so a rank reads only the tensors of its stage and nothing before the names and shapes are checked.
The HF model class is never instantiated. Writing (`write_hf_weights`): safetensors files of at most 5 GiB each
(model.safetensors, or model-0000i-of-0000n.safetensors + model.safetensors.index.json, as transformers writes
them). `copy_tokenizer_files` copies whichever of `TOKENIZER_FILES` a directory has; `write_sentencepiece_tokenizer`
turns a sentencepiece .model (data.tokenizer of a run) into tokenizer.model + a tokenizer_config.json that
transformers loads as LlamaTokenizer with the ids our SentencePieceTokenizer gives (no BOS/EOS added, special-token
text split like any text, as the training data was tokenized). A weight file that does not read (truncated,
garbage) is a ValueError naming it.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path
from typing import Iterator, Mapping

import torch
from tqdm import tqdm

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "generation_config.json")
SHARD_BYTES = 5 * 2**30
_WEIGHT_FILES = ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin.index.json",
                 "pytorch_model.bin")


def weight_files(hf_dir: str | Path) -> list[Path]:
    """The weight files of an HF directory (ValueError naming what is missing)."""
    hf_dir = Path(hf_dir)
    for name in _WEIGHT_FILES:
        path = hf_dir / name
        if not path.is_file():
            continue
        if not name.endswith(".index.json"):
            return [path]
        try:
            weight_map = json.loads(path.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path} is not a weight index ({type(e).__name__}: {e}): it is truncated or damaged; "
                             f"download or save the model again") from None
        files = [hf_dir / f for f in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ValueError(f"{path} names {len(absent)} missing file(s): {', '.join(absent[:3])}")
        return files
    raise ValueError(f"no weights in {hf_dir}: no file named {', '.join(_WEIGHT_FILES[1::-1])}, "
                     f"{_WEIGHT_FILES[3]} or {_WEIGHT_FILES[2]}")


def _unreadable(path: Path, what: str, e: BaseException) -> str:
    size = path.stat().st_size if path.exists() else 0
    first = " ".join(str(e).split()).split(". ")[0][:200]  # the first sentence: torch's go on with advice
    return f"{path} is not {what} ({first}; {size} bytes): it is truncated or damaged; download or save the model again"


class HFWeights(Mapping[str, torch.Tensor]):
    """The tensors of an HF checkpoint directory by name; safetensors are read on access, one tensor at a time."""

    def __init__(self, hf_dir: str | Path) -> None:
        from safetensors import SafetensorError, safe_open

        self.files = weight_files(hf_dir)
        self._where: dict[str, object] = {}  # name -> safe_open handle, or the loaded .bin state dict
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: set[str] = set()
        for path in self.files:
            if path.suffix == ".safetensors":
                try:  # the header, checked against the file's length
                    handle = safe_open(str(path), framework="pt")
                except SafetensorError as e:
                    raise ValueError(_unreadable(path, "a readable safetensors file", e)) from None
                names = list(handle.keys())
                for name in names:
                    view = handle.get_slice(name)
                    self.shapes[name] = tuple(view.get_shape())
                    self.dtypes.add(str(view.get_dtype()))
            else:
                try:
                    handle = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
                except (pickle.UnpicklingError, RuntimeError, EOFError) as e:
                    raise ValueError(_unreadable(path, "a readable PyTorch state dict", e)) from None
                if not isinstance(handle, dict):
                    raise ValueError(f"{path} holds a {type(handle).__name__}, not a state dict of tensors")
                names = list(handle)
                for name in names:
                    self.shapes[name] = tuple(handle[name].shape)
                    self.dtypes.add(str(handle[name].dtype).removeprefix("torch."))
            twice = [n for n in names if n in self._where]
            if twice:
                raise ValueError(f"tensor {twice[0]} appears in more than one weight file ({path.name})")
            self._where.update(dict.fromkeys(names, handle))

    def __getitem__(self, name: str) -> torch.Tensor:
        handle = self._where[name]
        return handle[name] if isinstance(handle, dict) else handle.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def storage_dtype(dtypes: set[str]) -> torch.dtype:
    """The dtype a converted checkpoint keeps: bfloat16 for bf16 weights, else float32 (fp16 has too little range
    for bf16 and is widened exactly)."""
    return torch.bfloat16 if dtypes <= {"BF16", "bfloat16"} else torch.float32


def write_hf_weights(tensors: Mapping[str, torch.Tensor], out_dir: str | Path, *, progress: bool = True,
                     shard_bytes: int = SHARD_BYTES) -> int:
    """Write `tensors` as safetensors shards of at most `shard_bytes`; returns the total bytes of the tensors."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    files = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    for file, names in tqdm(list(zip(files, shards)), desc="writing safetensors", disable=not progress):
        save_file({n: tensors[n].contiguous() for n in names}, str(out_dir / file), metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": {n: f for f, ns in zip(files, shards) for n in ns}}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return total


def tokenizer_files_in(path: str | Path) -> list[str]:
    path = Path(path)
    return [n for n in TOKENIZER_FILES if (path / n).is_file()] if path.is_dir() else []


def copy_tokenizer_files(src_dir: str | Path, dst_dir: str | Path) -> list[str]:
    """Copy the tokenizer files (and generation_config.json) `src_dir` has into `dst_dir`; returns their names."""
    names = tokenizer_files_in(src_dir)
    for name in names:
        shutil.copyfile(Path(src_dir) / name, Path(dst_dir) / name)
    return names


def directory_bytes(path: str | Path) -> int:
    """The bytes of the files under `path` (what a conversion wrote)."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def size_words(n: int) -> str:
    """`n` bytes in the largest binary unit that keeps it >= 1: '7.0 MiB', '15.02 GiB'."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}" if unit == "GiB" else f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _sentencepiece_proto(model: str | Path):
    from sentencepiece import sentencepiece_model_pb2  # needs protobuf, as transformers' conversion does

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(Path(model).read_bytes())
    return proto, sentencepiece_model_pb2.TrainerSpec.ModelType.Name(proto.trainer_spec.model_type)


def sentencepiece_problem(model: str | Path) -> str | None:
    """Why transformers' LlamaTokenizer (BPE with byte fallback, no normalizer) would not give the sentencepiece
    model's ids, or None when it does: another model type, a normalizer, or collapsed whitespace."""
    try:
        proto, kind = _sentencepiece_proto(model)
    except ImportError:
        return "reading a sentencepiece model's settings needs protobuf: pip install protobuf"
    norm = proto.normalizer_spec
    if kind != "BPE":
        return f"its model type is {kind}, and transformers' LlamaTokenizer is BPE"
    if norm.name not in ("identity", "") or norm.precompiled_charsmap:
        return f"it normalizes text ({norm.name}), which transformers' LlamaTokenizer does not"
    if norm.remove_extra_whitespaces:
        return "it collapses runs of whitespace, which transformers' LlamaTokenizer does not"
    return None


def write_sentencepiece_tokenizer(model: str | Path, dst_dir: str | Path) -> list[str]:
    """tokenizer.model (a copy of `model`) + tokenizer_config.json for transformers' LlamaTokenizer, whose ids
    equal SentencePieceTokenizer's: no BOS/EOS added, special-token text split like any text, the model's own
    special pieces (pad: eos when it has none, as ours); returns the names written. Check `sentencepiece_problem`
    first."""
    proto, _ = _sentencepiece_proto(model)
    spec = proto.trainer_spec
    ids = {"unk_token": spec.unk_id, "bos_token": spec.bos_id, "eos_token": spec.eos_id,
           "pad_token": spec.pad_id if spec.pad_id >= 0 else spec.eos_id}
    config = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": False, "add_eos_token": False,
              "add_prefix_space": proto.normalizer_spec.add_dummy_prefix, "legacy": False,
              "split_special_tokens": True, "clean_up_tokenization_spaces": False,
              **{name: proto.pieces[i].piece for name, i in ids.items() if i >= 0}}
    shutil.copyfile(model, Path(dst_dir) / "tokenizer.model")
    (Path(dst_dir) / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return ["tokenizer.model", "tokenizer_config.json"]
