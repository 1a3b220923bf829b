"""A one-process tp1/pp1 model for conversions, and megatron-core dist_checkpointing loads into any layout.

dist_checkpointing reshards on load (any tp/pp/cp/dp) and casts to the receiving parameters' dtype, so a
converted checkpoint (model only) loads into every run, and the model part of a training checkpoint loads alone
into a tp1/pp1 model (the optimizer and schedule are simply not asked for).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_upipe.models.presets import LlamaArch


@contextlib.contextmanager
def single_process_stage(arch: LlamaArch, vocab_size: int, dtype: torch.dtype = torch.float32):
    """This process as a one-rank gloo job (unless one is running) with a tp1/pp1 layout, and the model on it;
    megatron-core's parallel state is torn down on exit."""
    from megatron_upipe.models.llama import build_llama, llama_transformer_config
    from megatron_upipe.parallel import ParallelLayout, destroy_parallel, initialize_parallel

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # no rendezvous, no port
    layout = ParallelLayout()
    pg = initialize_parallel(layout)
    try:
        config = llama_transformer_config(arch, layout, dtype=dtype)
        yield build_llama(arch, layout, pg, vocab_size=vocab_size, config=config)
    finally:
        destroy_parallel()


def load_mcore_checkpoint(model, ckpt_dir: str | Path) -> None:
    """Load the model part of a dist_checkpointing checkpoint (converted or training) into a model of any layout;
    collective over all ranks."""
    from megatron.core import dist_checkpointing

    sharded = model.sharded_state_dict()
    loaded = dist_checkpointing.load(sharded, str(ckpt_dir))  # + a training checkpoint's common optimizer/schedule
    model.load_state_dict({k: loaded[k] for k in sharded}, strict=True)


def checkpoint_dtype(ckpt_dir: str | Path) -> torch.dtype:
    """The dtype of the model weights in a dist_checkpointing checkpoint (from its metadata, no tensor read)."""
    from megatron.core import dist_checkpointing

    metadata = dist_checkpointing.load_tensors_metadata(str(ckpt_dir))
    key = "embedding.word_embeddings.weight"
    if key not in metadata:
        key = next(k for k in metadata if not k.startswith("optimizer"))
    return metadata[key].dtype
