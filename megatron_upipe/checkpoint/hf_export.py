"""Our checkpoints -> an HF model directory that `transformers.AutoModelForCausalLM.from_pretrained` loads.

Sources (`inspect_export_source`, which reads JSON only and refuses bad input in one line):
  converted           hf-to-mcore output (upipe_model.json): its dist_checkpointing model;
  dist_checkpointing  a training checkpoint (a run directory with `latest`, or an iter_XXXXXXX directory) saved in
                      any tp/pp/cp/dp layout: its model part is loaded alone into a tp1/pp1 model in this process
                      (megatron-core reshards; the optimizer and schedule are not read);
  fsdp_per_rank       a Megatron-FSDP training checkpoint: fsdp_export.py relaunches its layout on CPU and gathers.
Output: config.json of the family (hf_families.py: qk_norm -> qwen3, qkv_bias -> qwen2, else llama; or
`model_type`), safetensors, and the tokenizer files when known (`tokenizer_source`).

Dtype: `dtype="auto"` writes the checkpoint's own weights in their dtype (float32 runs: float32; bf16 runs: the
bf16 compute weights the model trained with). `dtype="float32"` on a bf16 run writes the fp32 main weights where
the checkpoint keeps them beside the model (fsdp_per_rank); a dist_checkpointing checkpoint keeps them only inside
the optimizer state, so there the bf16 weights are widened (exact, but not the fp32 master copy). "bfloat16"
rounds float32 weights.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from megatron_upipe.checkpoint.hf_families import hf_config_dict
from megatron_upipe.checkpoint.hf_io import copy_tokenizer_files, tokenizer_files_in, write_hf_weights
from megatron_upipe.checkpoint.sources import (CONVERTED, HF, TRAIN_META, CheckpointError, classify_source,
                                               read_converted_meta)
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
            return folder, f"from data.tokenizer={spec}"
        return None, f"data.tokenizer={spec} is not an HF tokenizer directory or tokenizer.json found from here"
    load = config.get("checkpoint", {}).get("load")
    if load is not None and tokenizer_files_in(load):  # mock data: the tokenizer of the model it started from
        return Path(load), f"from checkpoint.load={load}"
    return None, "the run recorded no HF tokenizer"


def _load_dist(src: ExportSource, progress: bool) -> tuple[dict[str, torch.Tensor], torch.dtype]:
    from megatron_upipe.checkpoint.hf_convert import stage_to_hf
    from megatron_upipe.checkpoint.mcore_io import checkpoint_dtype, load_mcore_checkpoint, single_process_stage

    dtype = checkpoint_dtype(src.path)
    hf = {}
    with single_process_stage(src.arch, src.vocab_size, dtype) as stage:
        load_mcore_checkpoint(stage.model, src.path)
        for name, p in tqdm(list(stage.model.named_parameters()), desc="megatron -> HF", disable=not progress):
            hf.update(stage_to_hf([(name, p)], src.arch, src.vocab_size, tp_group=None, layer_offset=0))
    return hf, dtype


def convert_mcore_to_hf(ckpt: str | Path, hf_dir: str | Path, *, dtype: str = "auto", model_type: str | None = None,
                        progress: bool = True) -> str:
    """Export a converted or training checkpoint (see the module docstring); returns the summary line."""
    src = inspect_export_source(ckpt)
    config = hf_config_dict(src.arch, src.vocab_size, model_type)  # refuses a model_type the model is not
    want = DTYPES[dtype]
    if src.kind == FORMAT_FSDP:
        from megatron_upipe.checkpoint.fsdp_export import gather_fsdp_checkpoint

        print(f"gathering {src.world_size} per-rank files of {src.path} in {src.world_size} CPU processes", flush=True)
        hf = gather_fsdp_checkpoint(src.path, src.meta, src.world_size, main=want == torch.float32)
        native = next(iter(hf.values())).dtype
    else:
        hf, native = _load_dist(src, progress)
    out_dtype = want or native
    tensors = {k: v.to(out_dtype) for k, v in hf.items()}
    os.makedirs(hf_dir, exist_ok=True)
    total = write_hf_weights(tensors, hf_dir, progress=progress)
    (Path(hf_dir) / "config.json").write_text(json.dumps(
        {**config, "dtype": str(out_dtype).removeprefix("torch.")}, indent=2) + "\n")
    folder, why = tokenizer_source(src)
    names = copy_tokenizer_files(folder, hf_dir) if folder is not None else []
    words = f"tokenizer {', '.join(names)} {why}" if names else f"no tokenizer files: {why}"
    return (f"wrote HF {config['model_type']} model, {len(tensors)} tensors, {total / 2**30:.2f} GiB "
            f"({str(out_dtype).removeprefix('torch.')}; {words}), to {hf_dir}")
