"""HF model directory -> our checkpoint: checked whole before any weight is read, converted in one process.

`inspect_hf_dir(dir)` reads config.json (the family and every setting: hf_families.py) and the weight files'
headers (every tensor name and shape: hf_convert.check_hf_tensors) and raises ValueError / OSError on the first
problem. `convert_hf_to_mcore(hf_dir, out)` then copies the weights into a tp1/pp1 model (the HF weights' dtype:
bf16 stays bf16, anything else becomes float32), saves it with dist_checkpointing (model only: loadable into any
tp/pp/cp/dp layout as `checkpoint.load`, with a fresh optimizer and schedule), writes upipe_model.json and copies
the tokenizer files. `load_hf_dir_into_stage` does the same conversion in memory, per rank, for a run whose
`checkpoint.load` is an HF directory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from megatron_upipe.checkpoint.hf_convert import check_hf_tensors, check_tied_head, hf_to_stage, load_hf_into_model
from megatron_upipe.checkpoint.hf_families import arch_from_hf_config, family_of_arch, read_hf_config
from megatron_upipe.checkpoint.hf_io import (HFWeights, copy_tokenizer_files, directory_bytes, size_words,
                                             storage_dtype)
from megatron_upipe.checkpoint.sources import save_meta
from megatron_upipe.models.presets import LlamaArch


@dataclass
class HFCheckpoint:
    path: Path
    arch: LlamaArch
    vocab_size: int
    weights: HFWeights
    derived_buffers: int  # rotary_emb.inv_freq buffers skipped (recomputed from the config)

    @property
    def family(self) -> str:
        return family_of_arch(self.arch)


def inspect_hf_dir(hf_dir: str | Path) -> HFCheckpoint:
    """Config and tensor names/shapes of an HF directory, all checked; no tensor data read."""
    cfg = read_hf_config(hf_dir)
    arch, vocab = arch_from_hf_config(cfg)
    weights = HFWeights(hf_dir)
    skipped = check_hf_tensors(weights.shapes, arch, vocab)
    return HFCheckpoint(Path(hf_dir), arch, vocab, weights, skipped)


@torch.no_grad()
def convert_hf_to_mcore(hf_dir: str | Path, ckpt_dir: str | Path, progress: bool = True) -> str:
    """HF directory -> dist_checkpointing model checkpoint + upipe_model.json + tokenizer files; returns a summary
    line."""
    hf = inspect_hf_dir(hf_dir)
    check_tied_head(hf.weights, hf.arch)
    from megatron.core import dist_checkpointing

    from megatron_upipe.checkpoint.mcore_io import single_process_stage

    dtype = storage_dtype(hf.weights.dtypes)
    with single_process_stage(hf.arch, hf.vocab_size, dtype) as stage:
        params = list(stage.model.named_parameters())
        for name, p in tqdm(params, desc="HF -> megatron", disable=not progress):
            p.copy_(hf_to_stage(hf.weights, [name], hf.arch, stage.padded_vocab_size, tp_rank=0, tp=1,
                                layer_offset=0)[name])
        os.makedirs(ckpt_dir, exist_ok=True)
        dist_checkpointing.save(stage.model.sharded_state_dict(), str(ckpt_dir))
    tokenizer = copy_tokenizer_files(hf_dir, ckpt_dir)
    save_meta(ckpt_dir, hf.arch, hf.vocab_size, family=hf.family, dtype=str(dtype).removeprefix("torch."),
              source=str(Path(hf_dir).resolve()), tokenizer_files=tokenizer)
    skipped = f"; skipped {hf.derived_buffers} rotary_emb.inv_freq buffers (from the config)" \
        if hf.derived_buffers else ""
    return (f"wrote {hf.family} model ({len(hf.weights)} HF tensors -> {len(params)} megatron tensors, "
            f"{str(dtype).removeprefix('torch.')}, {size_words(directory_bytes(ckpt_dir))}; tokenizer files: "
            f"{', '.join(tokenizer) or 'none'}{skipped}) to {ckpt_dir}")


@torch.no_grad()
def load_hf_dir_into_stage(stage, hf_dir: str | Path, pg) -> None:
    """A run's `checkpoint.load=HF_DIR`: every rank converts the tensors of its own stage from the HF files."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    hf = inspect_hf_dir(hf_dir)
    check_tied_head(hf.weights, hf.arch)
    offset = get_transformer_layer_offset(stage.config, pp_rank=pg.pp.rank())
    load_hf_into_model(stage.model, hf.weights, hf.arch, stage.padded_vocab_size, tp_group=pg.tp,
                       layer_offset=offset)
