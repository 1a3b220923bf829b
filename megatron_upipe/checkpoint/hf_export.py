"""Our checkpoints -> an HF model directory that `transformers.AutoModelForCausalLM.from_pretrained` loads.

Sources (`inspect_export_source`, which reads JSON only and refuses bad input in one line):
  converted           hf-to-mcore output (upipe_model.json): its dist_checkpointing model;
  dist_checkpointing  a training checkpoint (a run directory with `latest`, or an iter_XXXXXXX directory) saved in
                      any tp/pp/cp/dp layout: its model part is loaded alone into a tp1/pp1 model in this process
                      (megatron-core reshards; the optimizer and schedule are not read);
  fsdp_per_rank       a Megatron-FSDP training checkpoint: fsdp_export.py relaunches its layout on CPU and gathers.
Output: config.json of the family (hf_families.py: qk_norm -> qwen3, qkv_bias -> qwen2, else llama; or
`model_type`), safetensors, and the tokenizer when known: the HF tokenizer files (`tokenizer_source`), or the
run's sentencepiece .model as tokenizer.model + a LlamaTokenizer tokenizer_config.json (`sentencepiece_source`;
hf_io.py), each only when it is the file the run trained with (train_state.json's tokenizer sha256). The summary
line gives the bytes written.

Damaged files are refused in one line naming the file and the fix (`check_files`, before any weight is read): a
file missing or of another size than the training checkpoint's manifest records, a `.metadata` that does not read,
a `.distcp` shorter than its `.metadata` says. Contents are checksummed against the manifest only when reading the
tensors fails, to name the damaged file (a resume reads every byte; an export would read optimizer states it does
not use).

Dtype: `dtype="auto"` writes the checkpoint's own weights in their dtype (float32 runs: float32; bf16 runs: the
bf16 compute weights the model trained with). `dtype="float32"` on a bf16 run writes the fp32 main weights where
the checkpoint keeps them beside the model (fsdp_per_rank); a dist_checkpointing checkpoint keeps them only inside
the optimizer state, so there the bf16 weights are widened (exact, but not the fp32 master copy). "bfloat16"
rounds float32 weights.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import pickle
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from megatron_upipe.checkpoint.hf_families import hf_config_dict
from megatron_upipe.checkpoint.hf_io import (copy_tokenizer_files, directory_bytes, sentencepiece_problem, size_words,
                                             tokenizer_files_in, write_hf_weights, write_sentencepiece_tokenizer)
from megatron_upipe.checkpoint.sources import (CONVERTED, HF, MANIFEST, TRAIN_META, CheckpointError, classify_source,
                                               describe_file_problem, file_problem, read_converted_meta,
                                               read_manifest)
from megatron_upipe.models.presets import LlamaArch

FORMAT_DIST, FORMAT_FSDP = "dist_checkpointing", "fsdp_per_rank"
DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}
_TE_STRATEGIES = ("p2p", "a2a", "a2a+p2p")


@dataclass(frozen=True)
class ExportSource:
    kind: str  # CONVERTED | FORMAT_DIST | FORMAT_FSDP
    path: Path  # the checkpoint directory itself (iter_XXXXXXX for a training checkpoint)
    arch: LlamaArch
    vocab_size: int
    meta: dict  # upipe_model.json or train_state.json

    @property
    def world_size(self) -> int:
        layout = self.meta.get("layout", {})
        return math.prod(layout.get(k, 1) for k in ("tp", "pp", "cp", "dp"))


def inspect_export_source(path: str | Path, setting: str = "--ckpt") -> ExportSource:
    """What `path` holds and whether it exports (CheckpointError, one line); reads JSON only."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{setting} {path} is not a directory: give a training checkpoint (run directory or "
                              f"iter_XXXXXXX) or a converted checkpoint")
    source = classify_source(path, setting)
    if source.kind == HF:
        raise CheckpointError(f"{setting} {path} is an HF model directory already (config.json): give a training "
                              f"checkpoint or a converted one")
    if source.kind == CONVERTED:
        meta = read_converted_meta(source.path)
        return ExportSource(CONVERTED, source.path, LlamaArch.from_dict(meta["arch"]), meta["vocab_size"], meta)
    meta = json.loads((source.path / TRAIN_META).read_text())
    fmt = meta.get("format", FORMAT_DIST)
    if fmt not in (FORMAT_DIST, FORMAT_FSDP):
        raise CheckpointError(f"{setting} {source.path}: unknown checkpoint format {fmt!r} (this version exports "
                              f"{FORMAT_DIST!r} and {FORMAT_FSDP!r})")
    try:
        arch = LlamaArch.from_dict(meta["model"])
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{setting} {source.path}: its model cannot be read by this version ({e})") from None
    out = ExportSource(fmt, source.path, arch, meta["model"]["vocab_size"], meta)
    if fmt == FORMAT_FSDP:
        strategy = meta.get("layout", {}).get("cp_strategy")
        if strategy in _TE_STRATEGIES:
            raise CheckpointError(f"{setting} {source.path}: a {FORMAT_FSDP} checkpoint of parallel.cp_strategy="
                                  f"{strategy} has TransformerEngine layers, which are not rebuilt on CPU for export")
        missing = [r for r in range(out.world_size) if not (source.path / "fsdp" / f"rank{r:05d}.pt").is_file()]
        if missing:
            raise CheckpointError(f"{setting} {source.path}: {len(missing)} of its {out.world_size} per-rank files "
                                  f"are missing (first: fsdp/rank{missing[0]:05d}.pt)")
    return out


def _changed_since_training(model_file: Path, src: ExportSource) -> bool:
    """Whether the tokenizer file differs from the one the run trained with (sha256 in train_state.json)."""
    recorded = (src.meta.get("tokenizer") or {}).get("sha256")
    return recorded is not None and hashlib.sha256(model_file.read_bytes()).hexdigest() != recorded


def tokenizer_source(src: ExportSource) -> tuple[Path | None, str]:
    """(directory holding the HF tokenizer files to copy, or None; why, in words)."""
    if src.kind == CONVERTED:
        return (src.path, "from the converted checkpoint") if tokenizer_files_in(src.path) else \
            (None, "the converted checkpoint has none")
    config = src.meta.get("config", {})
    spec = config.get("data", {}).get("tokenizer")
    if spec is not None:  # what the run trained with, if it is an HF tokenizer
        p = Path(spec)
        folder = p if p.is_dir() else p.parent if p.name == "tokenizer.json" else None
        if folder is not None and tokenizer_files_in(folder):
            if (folder / "tokenizer.json").is_file() and _changed_since_training(folder / "tokenizer.json", src):
                return None, f"data.tokenizer={spec} has changed since the run (its sha256 is not train_state.json's)"
            return folder, f"from data.tokenizer={spec}"
        return None, f"data.tokenizer={spec} is not an HF tokenizer directory or tokenizer.json found from here"
    load = config.get("checkpoint", {}).get("load")
    if load is not None and tokenizer_files_in(load):  # mock data: the tokenizer of the model it started from
        return Path(load), f"from checkpoint.load={load}"
    return None, "the run recorded no HF tokenizer"


def sentencepiece_source(src: ExportSource) -> tuple[Path | None, str | None]:
    """(the run's sentencepiece .model to export, or None; why, in words, or None when data.tokenizer is no
    sentencepiece file: an HF tokenizer, mock data, a converted checkpoint)."""
    spec = src.meta.get("config", {}).get("data", {}).get("tokenizer") if src.kind != CONVERTED else None
    if spec is None or Path(spec).is_dir() or Path(spec).suffix == ".json":
        return None, None
    model = Path(spec)
    if not model.is_file():
        return None, f"data.tokenizer={spec} is not found from here"
    if _changed_since_training(model, src):
        return None, f"data.tokenizer={spec} has changed since the run (its sha256 is not train_state.json's)"
    problem = sentencepiece_problem(model)
    if problem is not None:
        return None, f"data.tokenizer={spec} has no exact HF equivalent: {problem}"
    return model, f"from data.tokenizer={spec}"


def _export_tokenizer(src: ExportSource, hf_dir: Path) -> str:
    """Write the tokenizer into `hf_dir`; what was written, in words."""
    folder, why = tokenizer_source(src)
    if folder is not None:
        return f"tokenizer {', '.join(copy_tokenizer_files(folder, hf_dir))} {why}"
    model, spm_why = sentencepiece_source(src)
    if model is not None:
        return f"tokenizer {', '.join(write_sentencepiece_tokenizer(model, hf_dir))} {spm_why}"
    return f"no tokenizer files: {spm_why or why}"


# ----------------------------------------------------------------------------- damaged files
def _fix(src: ExportSource) -> str:
    if src.kind == CONVERTED:
        return "the checkpoint is damaged; convert the HF model again (hf-to-mcore)"
    return (f"the checkpoint is damaged; export an earlier one ({src.path.parent}/iter_XXXXXXX) or copy this one "
            f"again from where it was saved")


def _manifest_files(src: ExportSource) -> dict[str, dict]:
    """{relative path: {"bytes", "crc32"}} of a training checkpoint's manifest ({} without one)."""
    if src.kind == CONVERTED:
        return {}
    try:
        manifest = read_manifest(src.path)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{src.path / MANIFEST} is not a readable manifest ({e}): {_fix(src)}") from None
    return {} if manifest is None else manifest["files"]


def _error_words(e: BaseException) -> str:
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(e, CheckpointException) and e.failures:  # {rank: (exception, traceback)}
        e = next(iter(e.failures.values()))[0]
    return " ".join(f"{type(e).__name__}: {e}".split())[:200]


def check_files(src: ExportSource) -> None:
    """Refuse (CheckpointError, one line naming the file and the fix) a checkpoint whose files are missing, of
    another size than its manifest records, or (dist_checkpointing) whose .metadata does not read or whose .distcp
    files are shorter than it says. Reads file sizes and the .metadata only."""
    for rel, entry in sorted(_manifest_files(src).items()):
        path = src.path / rel
        problem = "missing" if not path.is_file() else "size" if path.stat().st_size != entry["bytes"] else None
        if problem is not None:
            raise CheckpointError(f"{describe_file_problem(src.path, rel, entry, problem)}: {_fix(src)}")
    if src.kind == FORMAT_FSDP:
        return
    from torch.distributed.checkpoint import FileSystemReader

    metadata_file = src.path / ".metadata"
    if not metadata_file.is_file():
        raise CheckpointError(f"{metadata_file} is missing: {_fix(src)}")
    try:
        metadata = FileSystemReader(str(src.path)).read_metadata()  # a pickle: what every load reads first
    except Exception as e:  # noqa: BLE001 - unpickling garbage raises anything (UnpicklingError, EOFError, ...)
        raise CheckpointError(f"{metadata_file} does not read ({_error_words(e)}): {_fix(src)}") from None
    need: dict[str, int] = {}
    for info in metadata.storage_data.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for rel, size in sorted(need.items()):
        path = src.path / rel
        if not path.is_file():
            raise CheckpointError(f"{path} is missing (its .metadata lists it): {_fix(src)}")
        if path.stat().st_size < size:
            raise CheckpointError(f"{path} has {path.stat().st_size} bytes, its .metadata needs {size} (truncated): "
                                  f"{_fix(src)}")


def _read_failure(src: ExportSource, e: BaseException) -> CheckpointError | None:
    """After reading the tensors failed: the first file whose contents differ from the manifest, or for a
    dist_checkpointing read error the error itself, as one line; None when neither explains it."""
    for rel, entry in sorted(_manifest_files(src).items()):
        problem = file_problem(src.path, rel, entry)
        if problem is not None:
            return CheckpointError(f"{describe_file_problem(src.path, rel, entry, problem)}: {_fix(src)}")
    if src.kind == FORMAT_FSDP:
        return None
    files = ", ".join(sorted(p.name for p in src.path.glob("*.distcp")))
    return CheckpointError(f"{src.path}: its tensor files ({files}) do not read ({_error_words(e)}): {_fix(src)}")


def _load_dist(src: ExportSource, progress: bool) -> tuple[dict[str, torch.Tensor], torch.dtype]:
    from torch.distributed.checkpoint.api import CheckpointException

    from megatron_upipe.checkpoint.hf_convert import stage_to_hf
    from megatron_upipe.checkpoint.mcore_io import checkpoint_dtype, load_mcore_checkpoint, single_process_stage

    hf = {}
    try:
        dtype = checkpoint_dtype(src.path)
        with single_process_stage(src.arch, src.vocab_size, dtype) as stage:
            load_mcore_checkpoint(stage.model, src.path)
            for name, p in tqdm(list(stage.model.named_parameters()), desc="megatron -> HF", disable=not progress):
                hf.update(stage_to_hf([(name, p)], src.arch, src.vocab_size, tp_group=None, layer_offset=0))
    except (CheckpointException, pickle.UnpicklingError, EOFError) as e:  # torch.distributed.checkpoint's read
        raise _read_failure(src, e) from None
    return hf, dtype


def convert_mcore_to_hf(ckpt: str | Path, hf_dir: str | Path, *, dtype: str = "auto", model_type: str | None = None,
                        progress: bool = True) -> str:
    """Export a converted or training checkpoint (see the module docstring); returns the summary line."""
    src = inspect_export_source(ckpt)
    config = hf_config_dict(src.arch, src.vocab_size, model_type)  # refuses a model_type the model is not
    check_files(src)
    want = DTYPES[dtype]
    if src.kind == FORMAT_FSDP:
        from megatron_upipe.checkpoint.fsdp_export import gather_fsdp_checkpoint

        print(f"gathering {src.world_size} per-rank files of {src.path} in {src.world_size} CPU processes", flush=True)
        try:
            hf = gather_fsdp_checkpoint(src.path, src.meta, src.world_size, main=want == torch.float32)
        except RuntimeError as e:  # a rank's traceback: a damaged file says so in one line, anything else as is
            damaged = _read_failure(src, e)
            if damaged is None:
                raise
            raise damaged from None
        native = next(iter(hf.values())).dtype
    else:
        hf, native = _load_dist(src, progress)
    out_dtype = want or native
    tensors = {k: v.to(out_dtype) for k, v in hf.items()}
    os.makedirs(hf_dir, exist_ok=True)
    write_hf_weights(tensors, hf_dir, progress=progress)
    (Path(hf_dir) / "config.json").write_text(json.dumps(
        {**config, "dtype": str(out_dtype).removeprefix("torch.")}, indent=2) + "\n")
    words = _export_tokenizer(src, Path(hf_dir))
    return (f"wrote HF {config['model_type']} model, {len(tensors)} tensors, {size_words(directory_bytes(hf_dir))} "
            f"({str(out_dtype).removeprefix('torch.')}; {words}), to {hf_dir}")
