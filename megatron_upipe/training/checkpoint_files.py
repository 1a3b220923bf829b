"""The files of a checkpoint at the lowest level: written durably (fsynced, directories too), and read back with
torch's weights_only loader when this project saved them (per-rank FSDP shards, RNG states), so that a file someone
else wrote cannot run code on load."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from megatron_upipe.checkpoint.sources import CheckpointError


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _save_file(obj, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


# What an RNG file of an earlier version holds besides tensors and plain values: numpy's state array. Allowed by
# name for weights_only loading; files written now hold a tensor instead (`checkpoint_rng._rng_state`).
_NUMPY_RNG_GLOBALS = (np._core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32)))


def load_own_file(path: Path, **kw):
    """torch.load of a file this project saved (per-rank FSDP shards, RNG states) with weights_only=True: tensors,
    plain containers and numbers only, so a checkpoint someone else wrote cannot run code on load. Anything else
    (a pickled callable, an unknown class) is a CheckpointError naming the file."""
    import pickle

    try:
        with torch.serialization.safe_globals(list(_NUMPY_RNG_GLOBALS)):
            return torch.load(path, map_location="cpu", weights_only=True, **kw)
    except pickle.UnpicklingError as e:
        what = " ".join(str(e).removeprefix("Weights only load failed.").split())
        raise CheckpointError(f"{path} holds more than tensors and plain values ({what[:200]}); refusing to load it: "
                              f"this project saves only those, so the file was not written by its save or was "
                              f"altered") from None
