"""What a checkpoint path holds, and whether its model fits a run (JSON files only: no torch, no weights read).

Three kinds of directory give a model's weights:
  training   a training checkpoint: `iter_XXXXXXX/` with train_state.json, or a run directory whose `latest` names
             one (training/checkpointing.py); format "dist_checkpointing" or "fsdp_per_rank";
  converted  `tools/convert_hf_llama.py hf-to-mcore` output: dist_checkpointing files of the model only, plus
             upipe_model.json (`save_meta`: the LlamaArch, vocab size, dtype, where it came from) and the HF
             tokenizer files;
  hf         an HF model directory: config.json + model.safetensors (or its sharded index, or pytorch_model.bin).
`classify_source(path)` tells them apart. `compare_models(saved, run)` compares two model dicts (LlamaArch fields
+ vocab_size, an older file's missing fields taking LlamaArch.from_dict's defaults): every field must match except
the RoPE fields (rotary_base, rope_scaling, max_position_embeddings), whose change is how a long-context extension
is run; those come back as a "RoPE changed from the checkpoint: ..." note. `initial_weights_problems(config)` is
the start-up (and --dry-run) check of `checkpoint.load` when it names a converted or HF directory.

A training checkpoint's manifest.json records each of its files' size and CRC-32 (written at save, before the
checkpoint is published: training/checkpointing.py); `file_problem` checks one file against it. CRC-32 (zlib, read in
8 MiB chunks) runs at about 3 GB/s on one core, so the cost is the read itself; training/checkpointing.py spreads
the files over the ranks. `resume_candidates(run_dir)` lists the complete checkpoints in the order a resume tries
them: the one `latest` names, then the others newest first (also when `latest` names nothing usable).
"""

from __future__ import annotations

import dataclasses
import json
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_upipe.models.presets import LlamaArch

META_FILE = "upipe_model.json"  # converted checkpoints
TRAIN_META = "train_state.json"  # training checkpoints
MANIFEST = "manifest.json"  # training checkpoints: {"files": {relative path: {"bytes", "crc32"}}, "total_bytes"}
LATEST = "latest"
CHECKPOINT_NAME = re.compile(r"^iter_(\d{7,})$")
_CHUNK = 8 << 20  # bytes read at a time for the CRC-32
TRAINING, CONVERTED, HF = "training", "converted", "hf"
KIND_WORDS = {TRAINING: "training checkpoint", CONVERTED: "converted HF checkpoint", HF: "HF model directory"}
ROPE_FIELDS = ("rotary_base", "rope_scaling", "max_position_embeddings")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used by this run (missing, or saved for another model / tokenizer)."""


@dataclass(frozen=True)
class Source:
    kind: str  # TRAINING | CONVERTED | HF
    path: Path  # for TRAINING the complete checkpoint (iter_XXXXXXX) itself

    @property
    def words(self) -> str:
        return KIND_WORDS[self.kind]


def find_checkpoint(path: str | Path) -> Path | None:
    """The complete training checkpoint `path` names: itself (it holds train_state.json) or the one its `latest`
    names; None when it is neither."""
    path = Path(path)
    if (path / TRAIN_META).is_file():
        return path
    latest = path / LATEST
    if latest.is_file():
        target = latest_target(path)
        if target is None:
            raise CheckpointError(f"{latest} names {_latest_words(path)}, which is not a complete checkpoint")
        return target
    return None


def _latest_text(root: Path) -> str:
    return (root / LATEST).read_bytes().decode("utf-8", errors="replace").strip()


def _latest_words(root: Path) -> str:
    text = _latest_text(root)
    return text if CHECKPOINT_NAME.match(text) else repr(text[:40])


def latest_target(root: Path) -> Path | None:
    """The complete checkpoint that `root/latest` names (its `.replaced` copy when killed while re-saving that
    step), None when `latest` is missing or names none (garbage, a removed or incomplete checkpoint)."""
    if not (root / LATEST).is_file():
        return None
    name = _latest_text(root)
    if not CHECKPOINT_NAME.match(name):
        return None
    for target in (root / name, root / (name + ".replaced")):
        if (target / TRAIN_META).is_file():
            return target
    return None


def complete_checkpoints(root: Path) -> list[Path]:
    """The complete checkpoints (iter_XXXXXXX holding train_state.json) of a run directory, newest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if CHECKPOINT_NAME.match(p.name) and (p / TRAIN_META).is_file()]
    return sorted(found, key=lambda p: int(CHECKPOINT_NAME.match(p.name).group(1)), reverse=True)


def resume_candidates(root: str | Path) -> tuple[list[Path], str | None]:
    """(the complete checkpoints of run directory `root` in the order a resume tries them: the one `latest` names,
    then the others newest first; one line when `root/latest` exists but names none of them, else None). Empty
    without a `latest` file (nothing published: a fresh start)."""
    root = Path(root)
    if not (root / LATEST).is_file():
        return [], None
    target = latest_target(root)
    others = [p for p in complete_checkpoints(root) if target is None or p.name != target.name.split(".")[0]]
    if target is not None:
        return [target, *others], None
    return others, f"{root / LATEST} names {_latest_words(root)}, which is not a complete checkpoint"


def crc32_file(path: Path) -> tuple[int, int]:
    """(size in bytes, CRC-32) of the file at `path`, read in 8 MiB chunks."""
    crc, size, buf = 0, 0, bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)  # releases the GIL on large buffers
            size += n
    return size, crc


def file_problem(ckpt: Path, rel: str, entry: dict) -> str | None:
    """How file `rel` of checkpoint `ckpt` differs from its manifest entry ({"bytes", "crc32"}): one of
    FILE_PROBLEMS, or None when it matches (the CRC-32 is read only when the size matches)."""
    try:
        size = (ckpt / rel).stat().st_size
        if size != entry["bytes"]:
            return "size"
        return None if crc32_file(ckpt / rel)[1] == entry["crc32"] else "crc32"
    except FileNotFoundError:
        return "missing"
    except OSError:
        return "unreadable"


FILE_PROBLEMS = ("missing", "unreadable", "size", "crc32")


def describe_file_problem(ckpt: Path, rel: str, entry: dict, problem: str) -> str:
    """One clause naming the file and what is wrong with it (`problem`: one of FILE_PROBLEMS)."""
    path = ckpt / rel
    if problem == "size":
        try:
            size = path.stat().st_size
            return f"{path} has {size} bytes, its manifest records {entry['bytes']} (truncated or overwritten)"
        except OSError:
            problem = "missing"
    if problem == "crc32":
        return f"{path} has the size its manifest records but not its CRC-32 (damaged or altered)"
    return f"{path} is missing" if problem == "missing" else f"{path} cannot be read"


def read_manifest(ckpt: Path) -> dict | None:
    """The checkpoint's manifest (None for one saved before manifests); ValueError when it is not a manifest."""
    if not (ckpt / MANIFEST).is_file():
        return None
    manifest = json.loads((ckpt / MANIFEST).read_text())
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise ValueError("no \"files\" table")
    return manifest


def classify_source(path: str | Path, setting: str = "checkpoint.load") -> Source:
    """Which kind of checkpoint `path` is (CheckpointError naming `setting` when none)."""
    path = Path(path)
    found = find_checkpoint(path)
    if found is not None:
        return Source(TRAINING, found)
    if (path / META_FILE).is_file():
        return Source(CONVERTED, path)
    if (path / "config.json").is_file():
        return Source(HF, path)
    raise CheckpointError(
        f"{setting}={path} is not a checkpoint: no train_state.json or `latest` file (a training checkpoint), no "
        f"{META_FILE} (tools/convert_hf_llama.py hf-to-mcore output), no config.json (an HF model directory)")


def save_meta(ckpt_dir: str | Path, arch: LlamaArch, vocab_size: int, **extra: Any) -> None:
    """upipe_model.json of a converted checkpoint: the arch, vocab size and `extra` (dtype, source, ...)."""
    meta = {"arch": dataclasses.asdict(arch), "vocab_size": vocab_size, **extra}
    (Path(ckpt_dir) / META_FILE).write_text(json.dumps(meta, indent=2))


def read_converted_meta(ckpt_dir: str | Path) -> dict[str, Any]:
    return json.loads((Path(ckpt_dir) / META_FILE).read_text())


def load_meta(ckpt_dir: str | Path) -> tuple[LlamaArch, int]:
    """(LlamaArch, vocab size) of a converted checkpoint."""
    meta = read_converted_meta(ckpt_dir)
    return LlamaArch.from_dict(meta["arch"]), meta["vocab_size"]


def source_model(source: Source) -> dict[str, Any]:
    """The model dict (LlamaArch fields, vocab_size = the checkpoint's vocabulary) of a checkpoint."""
    if source.kind == TRAINING:
        return dict(json.loads((source.path / TRAIN_META).read_text())["model"])
    if source.kind == CONVERTED:
        arch, vocab = load_meta(source.path)
    else:
        from megatron_upipe.checkpoint.hf_families import arch_from_hf_config, read_hf_config

        arch, vocab = arch_from_hf_config(read_hf_config(source.path))
    return {**dataclasses.asdict(arch), "vocab_size": vocab}


def normalise_model(d: dict[str, Any]) -> dict[str, Any]:
    """A saved model dict with LlamaArch.from_dict's defaults for the fields an older file lacks."""
    return dataclasses.asdict(LlamaArch.from_dict(d))


def _rope_words(field: str, value: Any) -> str:
    if field == "rope_scaling":
        if value is None:
            return "none"
        args = ", ".join(f"{k}={v}" for k, v in value.items() if k != "kind" and v is not None)
        return f"{value['kind']}({args})"
    return str(value)


def model_differences(saved: dict[str, Any], run: dict[str, Any]) -> tuple[list[tuple], list[tuple]]:
    """([(field, saved value, run value)] that must match, [the same for the RoPE fields])."""
    a, b = normalise_model(saved), normalise_model(run)
    diffs = [(k, a.get(k), v) for k, v in b.items() if a.get(k) != v]
    return [d for d in diffs if d[0] not in ROPE_FIELDS], [d for d in diffs if d[0] in ROPE_FIELDS]


def compare_models(saved: dict[str, Any], run: dict[str, Any]) -> tuple[list[str], str | None]:
    """(differences that refuse the checkpoint, each "model.X: checkpoint A != config B"; the RoPE note or None)."""
    diffs, rope = model_differences(saved, run)
    words = [f"model.{k}: checkpoint {a!r} != config {b!r}" for k, a, b in diffs]
    note = ", ".join(f"{k} {_rope_words(k, a)} -> {_rope_words(k, b)}" for k, a, b in rope)
    return words, ("RoPE changed from the checkpoint: " + note) if rope else None


def _override(key: str, value: Any) -> str:
    return f"model.{key}={str(value).lower() if isinstance(value, bool) else value}"


def resumes_from_dir(config) -> bool:
    """Whether the run resumes from checkpoint.dir (which then takes precedence over checkpoint.load)."""
    c = config.checkpoint
    if c.dir is None or c.resume is False:
        return False
    if (Path(c.dir) / TRAIN_META).is_file():
        return True
    return bool(resume_candidates(c.dir)[0])  # a `latest` that names nothing falls back to an older checkpoint


def run_vocab_size(config, tokenizer_vocab: int | None) -> int | None:
    """The run's model vocabulary (training/data.py model_vocab_size), from the tokenizer's size when it has one."""
    m = config.model
    if m.vocab_size is not None:
        return m.vocab_size
    if config.data.tokenizer is not None:
        return tokenizer_vocab
    arch_vocab = m.arch().vocab_size
    return None if arch_vocab is None else max(arch_vocab, 258)  # mock data's ByteTokenizer


def weights_mismatch(source: Source, config, vocab: int | None) -> tuple[str | None, str | None]:
    """(one-line refusal or None, RoPE note or None) for initialising the run's model from a converted or HF
    checkpoint."""
    saved = source_model(source)
    run = {**dataclasses.asdict(config.model.arch()), "vocab_size": vocab if vocab is not None else
           saved["vocab_size"]}
    diffs, note = compare_models(saved, run)
    if not diffs:
        return None, note
    fixes = " ".join(_override(k, a) for k, a, _ in model_differences(saved, run)[0])
    return (f"checkpoint.load={source.path} ({source.words}) does not match this run's model; refusing to load it: "
            + "; ".join(diffs) + f": set {fixes} (a vocabulary larger than the tokenizer's is fine)"), note


def initial_weights_problems(config, tokenizer_vocab: int | None) -> list[str]:
    """Start-up check of checkpoint.load (converted or HF directories; a training checkpoint is compared with the
    run when it is loaded, tokenizer included). Reads JSON only."""
    c = config.checkpoint
    if c.load is None or not Path(c.load).exists():
        return []
    try:
        if resumes_from_dir(config):
            return []
        source = classify_source(c.load)
        if source.kind == TRAINING:
            return []
        problem, _ = weights_mismatch(source, config, run_vocab_size(config, tokenizer_vocab))
    except CheckpointError as e:
        return [str(e)]
    except (OSError, ValueError) as e:  # an unreadable or unsupported config.json / upipe_model.json
        return [f"checkpoint.load={c.load}: {' '.join(str(e).split())}"]
    return [problem] if problem else []
