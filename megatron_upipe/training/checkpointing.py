"""Checkpoints: megatron-core dist_checkpointing, written atomically, resumable into any parallel layout.

Layout of `checkpoint.dir`:
    iter_0000025/            one complete checkpoint (dist_checkpointing files + the two below)
        train_state.json     step, consumed samples, model shape, tokenizer fingerprint, layout, config
        rng/rank00000.pt     each rank's RNG states (torch, CUDA, megatron's tracker, python, numpy)
    latest                   the name of the newest complete checkpoint ("iter_0000025")
    iter_0000050.tmp/        a save in progress (or one killed mid-way: ignored, removed by the next save)
    iter_0000025.replaced/   only while step 25 is saved again over an older save of it (resume=false runs)

Atomic save: all ranks write into `iter_XXXXXXX.tmp`; after a barrier (every rank finished), rank 0 writes
train_state.json, renames the directory to `iter_XXXXXXX` and then replaces `latest` (write-temp, fsync,
os.replace). A process killed at any point leaves `latest` naming the previous complete checkpoint. keep_last then
prunes the oldest complete checkpoints (never the one `latest` names).

Resume: `find_checkpoint(path)` accepts a checkpoint directory or a run directory holding `latest`. Before loading
any tensor, the saved model shape and tokenizer are compared with the run's, and a mismatch is refused with a
message naming each differing field. Weights and optimizer state are resharded by dist_checkpointing, so a
checkpoint loads into another TP/PP/CP/DP layout (the optimizer must be the non-distributed one, see optim.py).
megatron-core's writer (torch_dist strategy) starts a multiprocessing Manager (spawn) in every rank that writes
shards, on its first save: the entry script needs its `if __name__ == "__main__"` guard, and a SIGKILLed rank leaves
that Manager orphaned (a batch scheduler's job clean-up removes it; on a workstation kill it by hand).
RNG states are restored only into the same layout (otherwise there is no rank-to-rank correspondence; the Llama
model has no dropout, so training is unaffected); the data position comes from the consumed-sample count.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

META = "train_state.json"
LATEST = "latest"
_ITER = re.compile(r"^iter_(\d{7,})$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used by this run (missing, or saved for another model / tokenizer)."""


def checkpoint_name(step: int) -> str:
    return f"iter_{step:07d}"


def find_checkpoint(path: str | Path) -> Path | None:
    """The complete checkpoint `path` names: itself (it holds train_state.json) or the one its `latest` names."""
    path = Path(path)
    if (path / META).is_file():
        return path
    latest = path / LATEST
    if latest.is_file():
        target = path / latest.read_text().strip()
        if (target / META).is_file():
            return target
        replaced = target.with_name(target.name + ".replaced")  # killed while re-saving the step `latest` names
        if (replaced / META).is_file():
            return replaced
        raise CheckpointError(f"{latest} names {target.name}, which is not a complete checkpoint")
    return None


def read_meta(ckpt: Path) -> dict:
    return json.loads((ckpt / META).read_text())


def check_compatible(meta: dict, expected: dict, ckpt: Path) -> None:
    """Refuse a checkpoint whose model shape or tokenizer differs from the run's, naming every differing field."""
    diffs = [f"model.{k}: checkpoint {meta['model'].get(k)!r} != config {v!r}"
             for k, v in expected["model"].items() if meta["model"].get(k) != v]
    diffs += [f"tokenizer {k}: checkpoint {meta['tokenizer'].get(k)!r} != run {v!r}"
              for k, v in expected["tokenizer"].items() if meta["tokenizer"].get(k) != v]
    if diffs:
        raise CheckpointError(f"checkpoint {ckpt} does not match this run's model/tokenizer; refusing to load it:\n- "
                              + "\n- ".join(diffs))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _rng_state() -> dict:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available()
            else None, "tracker": get_cuda_rng_tracker().get_states(), "python": random.getstate(),
            "numpy": np.random.get_state()}


def _set_rng_state(s: dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(s["torch"])
    if s["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])
    get_cuda_rng_tracker().set_states(s["tracker"])
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])


def _sharded_state_dict(state, is_loading: bool) -> dict:
    model_sd = state.model.sharded_state_dict()
    return {"model": model_sd, "optimizer": state.optimizer.sharded_state_dict(model_sd, is_loading=is_loading),
            "scheduler": state.scheduler.state_dict()}


def save_checkpoint(state, root: str | Path, keep_last: int | None = None, before_publish=None) -> Path:
    """Save `state` (a TrainState) as `root/iter_<step>`; every rank calls it. Returns the checkpoint path.
    `before_publish(tmp_dir)` runs on rank 0 after all shards are written and before the rename (tests)."""
    from megatron.core import dist_checkpointing

    root, rank = Path(root), dist.get_rank()
    name = checkpoint_name(state.step)
    tmp, final = root / (name + ".tmp"), root / name
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        latest = None
        with contextlib.suppress(CheckpointError):
            latest = find_checkpoint(root)
        for stale in [*root.glob("iter_*.tmp"), *root.glob("iter_*.replaced")]:  # left by a killed save
            if stale != latest:
                shutil.rmtree(stale)
        tmp.mkdir()
    dist.barrier()
    dist_checkpointing.save(_sharded_state_dict(state, is_loading=False), str(tmp))
    (tmp / "rng").mkdir(exist_ok=True)
    torch.save(_rng_state(), tmp / "rng" / f"rank{rank:05d}.pt")
    dist.barrier()  # every rank's shards and RNG file are on disk
    if rank == 0:
        (tmp / META).write_text(json.dumps(state.meta(), indent=2))
        if before_publish is not None:
            before_publish(tmp)
        replaced = None
        if final.exists():  # this step was saved before (a run with checkpoint.resume=false, or a killed one)
            replaced = final.with_name(name + ".replaced")  # still found through `latest` until the new one is in
            if replaced.exists():
                shutil.rmtree(replaced)
            os.rename(final, replaced)
        os.rename(tmp, final)
        _fsync_dir(root)
        _write_atomic(root / LATEST, name + "\n")
        if replaced is not None:
            shutil.rmtree(replaced)
        if keep_last is not None:
            prune(root, keep_last)
    dist.barrier()
    return final


def prune(root: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` complete checkpoints (never the one `latest` names)."""
    latest = (root / LATEST).read_text().strip() if (root / LATEST).is_file() else None
    done = sorted((p for p in root.iterdir() if _ITER.match(p.name) and (p / META).is_file()),
                  key=lambda p: int(_ITER.match(p.name).group(1)))
    removed = [p for p in done[:-keep_last] if p.name != latest]
    for p in removed:
        shutil.rmtree(p)
    return removed


def load_checkpoint(state, ckpt: Path) -> dict:
    """Load `ckpt` into `state` (model, optimizer, schedule, RNG if same layout); returns its metadata."""
    from megatron.core import dist_checkpointing

    meta = read_meta(ckpt)
    check_compatible(meta, state.meta(), ckpt)
    loaded = dist_checkpointing.load(_sharded_state_dict(state, is_loading=True), str(ckpt))
    state.model.load_state_dict(loaded["model"], strict=True)
    state.optimizer.load_state_dict(loaded["optimizer"])
    state.scheduler.load_state_dict(loaded["scheduler"])
    rng_file = ckpt / "rng" / f"rank{dist.get_rank():05d}.pt"
    if meta["layout"] == dataclasses.asdict(state.groups.layout) and rng_file.is_file():
        _set_rng_state(torch.load(rng_file, weights_only=False))
    return meta
