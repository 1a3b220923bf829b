"""Each rank's RNG states in a checkpoint (rng/rankNNNNN.pt: torch, CUDA, megatron's tracker, python, numpy):
captured at save, restored on load only into the layout they were saved in (checkpointing.py)."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megatron_upipe.checkpoint.sources import CheckpointError
from megatron_upipe.training.agree import largest_on_any_rank
from megatron_upipe.training.checkpoint_files import load_own_file


def _rng_state() -> dict:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available()
            else None, "tracker": get_cuda_rng_tracker().get_states(), "python": random.getstate(),
            "numpy": _numpy_state_as_tensor(np.random.get_state())}


def _numpy_state_as_tensor(state: tuple) -> tuple:
    """numpy's legacy RNG state with its key array as a tensor (loadable with weights_only=True)."""
    name, keys, pos, has_gauss, gauss = state
    return name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss


def _numpy_state_from_saved(state: tuple) -> tuple:
    name, keys, pos, has_gauss, gauss = state
    keys = keys.numpy().astype(np.uint32) if torch.is_tensor(keys) else keys  # an older file: the array itself
    return name, keys, pos, has_gauss, gauss


def _set_rng_state(s: dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(s["torch"])
    if s["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])
    get_cuda_rng_tracker().set_states(s["tracker"])
    random.setstate(s["python"])
    np.random.set_state(_numpy_state_from_saved(s["numpy"]))


def _read_rng_file(state, ckpt: Path, meta: dict) -> dict | None:
    """This rank's RNG states when the checkpoint has the run's layout (else None); a file that is not plain data
    is refused on every rank (one all-reduce), not only on the rank that reads it."""
    rng_file = ckpt / "rng" / f"rank{dist.get_rank():05d}.pt"
    if meta["layout"] != dataclasses.asdict(state.groups.layout):  # the same verdict on every rank
        return None
    rng, problem = None, None
    try:
        rng = load_own_file(rng_file) if rng_file.is_file() else None
    except CheckpointError as e:
        problem = e
    if largest_on_any_rank([problem is not None], state.groups.device)[0]:
        raise problem or CheckpointError(f"checkpoint {ckpt}: another rank's RNG file is not plain data (see its "
                                         f"message); refusing to load it")
    return rng
