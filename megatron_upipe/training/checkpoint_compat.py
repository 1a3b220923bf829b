"""Which format a run's checkpoints are in, and refusing, before any tensor is read, a checkpoint that does not fit
the run: another model shape or tokenizer, the other format, or a per-rank FSDP checkpoint of another tp/pp/cp/dp
layout (checkpointing.py, Formats and Resume)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from megatron_upipe.checkpoint.sources import CheckpointError, compare_models

FORMAT_DIST = "dist_checkpointing"  # also what a checkpoint without a "format" field is
FORMAT_FSDP = "fsdp_per_rank"
_FSDP_LAYOUT = ("tp", "pp", "cp", "dp")  # what fixes Megatron-FSDP's buffer slicing (with the model and precision)


def check_compatible(meta: dict, expected: dict, ckpt: Path) -> str | None:
    """Refuse a checkpoint whose model shape or tokenizer differs from the run's, naming every differing field.

    The RoPE fields (model.rotary_base, rope_scaling, max_position_embeddings) may differ (a long-context
    extension): returned as one "RoPE changed from the checkpoint: ..." note (None when equal). The saved model of
    an older checkpoint without the newer fields (qkv_bias, qk_norm, ...) takes LlamaArch's defaults for them."""
    try:
        diffs, note = compare_models(meta["model"], expected["model"])
    except (TypeError, ValueError) as e:  # a field this version does not know
        raise CheckpointError(f"checkpoint {ckpt} records a model this version cannot read ({e}); refusing to "
                              f"load it") from None
    diffs += [f"tokenizer {k}: checkpoint {meta['tokenizer'].get(k)!r} != run {v!r}"
              for k, v in expected["tokenizer"].items() if meta["tokenizer"].get(k) != v]
    if diffs:
        raise CheckpointError(f"checkpoint {ckpt} does not match this run's model/tokenizer; refusing to load it:\n- "
                              + "\n- ".join(diffs))
    return note


def checkpoint_format(state) -> str:
    """FORMAT_FSDP for a run whose model states Megatron-FSDP shards (memory.shard_model_states), else FORMAT_DIST."""
    ddp_config = getattr(state.ddp, "ddp_config", None)
    if state.config.memory.shard_model_states or getattr(ddp_config, "use_megatron_fsdp", False):
        return FORMAT_FSDP
    return FORMAT_DIST


def check_format(meta: dict, state, ckpt: Path) -> None:
    """Refuse a checkpoint of the other format, or a per-rank FSDP checkpoint saved in another tp/pp/cp/dp layout
    (both read from train_state.json, before any tensor)."""
    saved, current = meta.get("format", FORMAT_DIST), checkpoint_format(state)
    layout = dataclasses.asdict(state.groups.layout)
    if saved not in (FORMAT_DIST, FORMAT_FSDP):
        raise CheckpointError(f"checkpoint {ckpt} has an unknown format {saved!r} (this version reads "
                              f"{FORMAT_DIST!r} and {FORMAT_FSDP!r}); refusing to load it")
    if saved != current:
        if saved == FORMAT_DIST:
            raise CheckpointError(
                f"checkpoint {ckpt} was saved in the {FORMAT_DIST!r} format (a run with memory.shard_model_states="
                f"false), but this run fully shards its model states (memory.shard_model_states=true), which loads "
                f"only its own per-rank format {FORMAT_FSDP!r}; refusing to load it: resume with "
                f"memory.shard_model_states=false (any tp/pp/cp/dp), or start the sharded run from scratch")
        saved_layout = meta.get("layout", {})
        raise CheckpointError(
            f"checkpoint {ckpt} was saved in the per-rank format {FORMAT_FSDP!r} of a run with "
            f"memory.shard_model_states=true, which loads only into such a run in the same layout; this run has "
            f"memory.shard_model_states=false; refusing to load it: resume with memory.shard_model_states=true and "
            f"{_layout_words(saved_layout)}")
    if saved == FORMAT_FSDP:
        saved_layout = meta.get("layout", {})
        diffs = [f"parallel.{k}: checkpoint {saved_layout.get(k)!r} != run {layout[k]!r}"
                 for k in _FSDP_LAYOUT if saved_layout.get(k) != layout[k]]
        if diffs:
            raise CheckpointError(
                f"checkpoint {ckpt} is in the per-rank format {FORMAT_FSDP!r} of fully sharded model states, which "
                f"loads only into the tp/pp/cp/dp layout it was saved in; refusing to load it:\n- "
                + "\n- ".join(diffs) + f"\nResume with the same tp/pp/cp/dp ({_layout_words(saved_layout)}), or "
                f"start the new layout from scratch (a per-rank checkpoint is not resharded)")


def _layout_words(layout: dict) -> str:
    words = " ".join(f"parallel.{k}={layout.get(k)}" for k in _FSDP_LAYOUT)
    sizes = [layout.get(k) for k in _FSDP_LAYOUT]
    if all(isinstance(v, int) for v in sizes):
        words += f" (world size {int(np.prod(sizes))})"
    return words
