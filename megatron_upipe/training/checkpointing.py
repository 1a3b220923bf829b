"""Checkpoints: megatron-core dist_checkpointing (resumable into any parallel layout), or, for fully sharded model
states, one file of local shards per rank (same layout only); both written atomically.

Layout of `checkpoint.dir`:
    iter_0000025/            one complete checkpoint (the format's files + the three below)
        train_state.json     step, consumed samples, model shape, tokenizer fingerprint, layout, config, format
        rng/rank00000.pt     each rank's RNG states (torch, CUDA, megatron's tracker, python, numpy)
        manifest.json        every other file's size and CRC-32, and their total (see Integrity)
    latest                   the name of the newest complete checkpoint ("iter_0000025")
    latest.tmp               the next `latest`, staged before the publish rename (left only by a killed save)
    iter_0000050.tmp/        a save in progress (or one killed mid-way: ignored, removed by the next save)
    iter_0000025.replaced/   only while step 25 is saved again over an older save of it (resume=false runs)

Formats (train_state.json's "format"; a checkpoint without the field is "dist_checkpointing"):
- "dist_checkpointing": megatron-core's dist_checkpointing files (torch_dist strategy) of the model, the optimizer
  and the LR schedule. Weights and optimizer state are resharded on load, so such a checkpoint loads into another
  TP/PP/CP/DP layout (the optimizer must be the non-distributed one, see optim.py).
- "fsdp_per_rank" (memory.shard_model_states=true, Megatron-FSDP; dist_checkpointing refuses its optimizer, see
  memory_switches/sharding.py): `fsdp/rank00000.pt` ... one torch.save file per rank holding exactly what that rank
  owns: its slices of Megatron-FSDP's flat buffers (compute parameters, fp32 main parameters; gradients are not
  state between steps), the local parts of Adam's exp_avg / exp_avg_sq and its step counts keyed by parameter name
  (a parameter whose local slice is empty has no Adam state on that rank), the optimizer's hyper-parameter groups
  and the LR schedule. Nothing is gathered or resharded: it loads only into the same tp/pp/cp/dp layout (same world
  size, same model and precision, hence the same buffer slicing), which is checked before any tensor is read; there
  is no conversion to another layout or to dist_checkpointing. `tools/convert_hf_llama.py mcore-to-hf` exports it
  (relaunching the layout on CPU and loading the model buffers alone: `load_fsdp_model_buffers`).

Atomic save: all ranks write into `iter_XXXXXXX.tmp`; once every rank has finished (and checksummed its files),
rank 0 writes train_state.json, manifest.json and latest.tmp (each fsynced), renames the directory to
`iter_XXXXXXX` and then replaces `latest` with latest.tmp (os.replace): publishing writes no data, so a full disk
fails the save before it. A process killed at any point leaves `latest` naming the previous complete
checkpoint. keep_last then prunes the oldest complete checkpoints (never the one `latest` names).

Save errors: before anything is written, rank 0 compares the free space of checkpoint.dir's filesystem
(shutil.disk_usage) with the checkpoint's expected size: the newest complete checkpoint's (its manifest's total),
else the model + optimizer tensor bytes of all ranks (replicas over dp x cp counted once; an estimate without the
small metadata). Too little is refused before writing, in one line "no space left on <device> (mounted on <path>):
need X GiB (...), have Y GiB free ...". A writer failure on any rank (OSError, RuntimeError, dist_checkpointing's
CheckpointException: a disk that fills up mid-save) is gathered on rank 0, which removes the partial
`iter_XXXXXXX.tmp`; then every rank raises `SaveFailed` with the same one line (`latest` unchanged, the training
state untouched: a save only reads it). training/loop.py applies checkpoint.on_save_error (stop: exit 6; continue).

Integrity: after writing, every rank computes the CRC-32 (zlib, 8 MiB reads, ~3 GB/s on one core) of the files it
wrote itself (torch_dist's `__<rank>_<n>.distcp`, its fsdp/ and rng/ files; rank 0 also the shared ones: .metadata,
metadata.json, common.pt), and rank 0 gathers the sizes and checksums into manifest.json before the publish rename,
so a published checkpoint always has one. The cost is one re-read of each rank's own files (usually still in the
page cache), in parallel over the ranks: about (bytes written by the busiest rank) / min(read rate, 3 GB/s), e.g.
~3 s per 10 GB on that rank; the tiny CPU test checkpoints (7-10 MB) take about 3 ms. A resume from checkpoint.dir
(training/build.py -> `resume_checkpoint`, every rank) verifies each candidate before any
tensor is read: the files are dealt out over the ranks (largest first), each rank re-reads about 1/world of the
bytes, and one all-reduce gives every rank the same verdict (the first mismatching file). A mismatch (size,
CRC-32, a missing file, an unreadable train_state.json or manifest) is named in one line; by default
(checkpoint.on_corrupt=fallback) the newest intact complete checkpoint is resumed instead, with a warning line
saying which checkpoint was skipped and why; checkpoint.on_corrupt=stop refuses (exit 2). A `latest` that names
nothing (garbage, a removed checkpoint) falls back the same way. A checkpoint saved before manifests loads
unverified (said once). A training checkpoint named by checkpoint.load is not verified.

Resume: `find_checkpoint(path)` (checkpoint/sources.py: what `latest` names, unread) accepts a checkpoint directory
or a run directory holding `latest`; `resume_checkpoint(root)` is the verified lookup of a resume. Before loading
any tensor, the saved model shape and tokenizer are compared with the run's, and a mismatch is refused with a
message naming each differing field; so are a checkpoint of the other format (dist_checkpointing into a fully
sharded run or the reverse) and, for "fsdp_per_rank", a different tp/pp/cp/dp layout. The RoPE fields
(model.rotary_base, rope_scaling, max_position_embeddings) may change (a long-context extension): logged as one
"RoPE changed from the checkpoint: ..." line. The model of an older train_state.json without the newer fields
(qkv_bias, qk_norm, tie_embeddings, rope_scaling) is read with their defaults, so old checkpoints still resume.
`checkpoint.load` may also name a converted HF checkpoint or an HF directory (weights only, loaded before the model
is wrapped: training/build.py and megatron_upipe/checkpoint/sources.py).
megatron-core's writer (torch_dist strategy) starts a multiprocessing Manager (spawn) in every rank that writes
shards, on its first save: the entry script needs its `if __name__ == "__main__"` guard, and a SIGKILLed rank leaves
that Manager orphaned (a batch scheduler's job clean-up removes it; on a workstation kill it by hand).
RNG states are restored only into the same layout (otherwise there is no rank-to-rank correspondence; the Llama
model has no dropout, so training is unaffected); the data position comes from the consumed-sample count.

Modules (training/): checkpointing.py the public save/load API (this file); checkpoint_manifest.py the manifest and
the verified resume lookup with fallback; fsdp_checkpoint.py the "fsdp_per_rank" format; checkpoint_compat.py the
format of a run and the refusals before any tensor is read; checkpoint_save_errors.py the free-space check and the
one-line save errors; checkpoint_rng.py the RNG states; checkpoint_files.py fsynced writes and weights_only reads.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import CheckpointException  # dist_checkpointing's, on every rank, when a rank failed

from megatron_upipe.checkpoint import sources
from megatron_upipe.checkpoint.sources import LATEST, CheckpointError
from megatron_upipe.checkpoint.sources import find_checkpoint  # noqa: F401 (named here by training code and tests)
from megatron_upipe.checkpoint.sources import TRAIN_META as META
from megatron_upipe.training.checkpoint_compat import FORMAT_FSDP, check_compatible, check_format, checkpoint_format
from megatron_upipe.training.checkpoint_files import _fsync_dir, _save_file, _write_synced
from megatron_upipe.training.checkpoint_manifest import (_entry, _from_rank0, _own_files, _resume_notes,
                                                         _write_manifest)
from megatron_upipe.training.checkpoint_rng import _read_rng_file, _rng_state, _set_rng_state
from megatron_upipe.training.checkpoint_save_errors import (_error_line, _not_saved, _space_refusal, _state_bytes,
                                                            _write_failure)
from megatron_upipe.training.fsdp_checkpoint import FSDP_DIR, _fsdp_rank_state, _load_fsdp
from megatron_upipe.training.signals import blocked_in_children

# Kept importable from here, where other code and tests name them (build.py: resume_checkpoint;
# checkpoint/fsdp_export.py: load_fsdp_model_buffers, load_own_file; tests/test_nothing_lost.py: the numpy RNG state
# helpers); each lives in the module named.
from megatron_upipe.training.checkpoint_compat import FORMAT_DIST  # noqa: F401
from megatron_upipe.training.checkpoint_files import load_own_file  # noqa: F401
from megatron_upipe.training.checkpoint_manifest import ResumePoint, resume_checkpoint, verify_checkpoint  # noqa: F401
from megatron_upipe.training.checkpoint_rng import _numpy_state_as_tensor, _numpy_state_from_saved  # noqa: F401
from megatron_upipe.training.fsdp_checkpoint import load_fsdp_model_buffers  # noqa: F401

EXIT_SAVE_FAILED = 6  # pretrain_llama.py's exit status when a checkpoint could not be saved


class SaveFailed(Exception):
    """A checkpoint could not be saved (too little free space, or the writer failed on some rank): nothing was
    published, the partial save is removed, `latest` names the previous checkpoint. Every rank raises it with the same
    one-line message."""


def checkpoint_name(step: int) -> str:
    return f"iter_{step:07d}"


def read_meta(ckpt: Path) -> dict:
    return json.loads((ckpt / META).read_text())


def _sharded_state_dict(state, is_loading: bool) -> dict:
    model_sd = state.model.sharded_state_dict()
    return {"model": model_sd, "optimizer": state.optimizer.sharded_state_dict(model_sd, is_loading=is_loading),
            "scheduler": state.scheduler.state_dict()}


def save_checkpoint(state, root: str | Path, keep_last: int | None = None, before_publish=None) -> Path:
    """Save `state` (a TrainState) as `root/iter_<step>`; every rank calls it. Returns the checkpoint path; raises
    SaveFailed on every rank when too little space is free or the writer fails (nothing published, the partial save
    removed). `before_publish(tmp_dir)` runs on rank 0 after all shards are written and before the rename (tests)."""
    root, rank, world = Path(root), dist.get_rank(), dist.get_world_size()
    fmt = checkpoint_format(state)
    tmp, final = root / (checkpoint_name(state.step) + ".tmp"), root / checkpoint_name(state.step)
    estimate = torch.tensor([_state_bytes(state, fmt)], dtype=torch.int64, device=state.groups.device)
    dist.all_reduce(estimate)  # the checkpoint's tensor bytes, for a directory without a checkpoint yet
    refusal = _from_rank0(_prepare(root, tmp, int(estimate.item())) if rank == 0 else None)
    if refusal is not None:
        raise SaveFailed(_not_saved(final, refusal))
    error, entries = None, {}
    try:
        _write_rank_files(state, tmp, fmt)
        entries = {rel: _entry(tmp / rel) for rel in _own_files(tmp, rank, world)}
    except (OSError, RuntimeError, CheckpointException) as e:
        if isinstance(e, getattr(dist, "DistBackendError", ())):
            raise  # a peer is gone: a distributed failure (failures.py), not a save error
        error = _error_line(e, rank)
    parts = [None] * world if rank == 0 else None
    dist.gather_object((error, entries), parts, dst=0)  # every rank's files are on disk (or failed)
    failure = _from_rank0(_seal(state, fmt, tmp, parts) if rank == 0 else None)
    if failure is not None:
        raise SaveFailed(_not_saved(final, failure))
    if rank == 0:
        if before_publish is not None:
            before_publish(tmp)
        _publish(tmp, final, keep_last)
    dist.barrier()
    return final


def _prepare(root: Path, tmp: Path, estimate: int) -> str | None:
    """Rank 0, before any rank writes: remove what killed saves left, check the free space, make `tmp`; the reason
    when the save cannot go ahead (None when it can)."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        latest = None
        with contextlib.suppress(CheckpointError):
            latest = sources.find_checkpoint(root)
        for stale in [*root.glob("iter_*.tmp"), *root.glob("iter_*.replaced")]:  # left by a killed save
            if stale != latest:
                shutil.rmtree(stale)
        refusal = _space_refusal(root, latest, estimate)
        if refusal is None:
            tmp.mkdir()
        return refusal
    except OSError as e:
        return f"preparing it failed: {_error_line(e, 0)}"


def _seal(state, fmt: str, tmp: Path, parts: list) -> str | None:
    """Rank 0, every rank's (error, {file: entry}) gathered: write train_state.json, the manifest and the staged
    `latest`; on any rank's error (or its own) remove `tmp` and return the one-line reason, else None."""
    root, failure = tmp.parent, _write_failure(tmp.parent, [e for e, _ in parts if e is not None])
    if failure is None:
        try:
            _write_synced(tmp / META, json.dumps({**state.meta(), "format": fmt}, indent=2))
            files = {rel: entry for _, part in parts for rel, entry in part.items()} | {META: _entry(tmp / META)}
            _write_manifest(tmp, files)
            _write_synced(root / (LATEST + ".tmp"), tmp.name.removesuffix(".tmp") + "\n")  # publishing only renames
        except OSError as e:
            failure = _write_failure(root, [_error_line(e, 0)])
    if failure is not None:
        shutil.rmtree(tmp, ignore_errors=True)
        (root / (LATEST + ".tmp")).unlink(missing_ok=True)
    return failure


def _publish(tmp: Path, final: Path, keep_last: int | None) -> None:
    """Rank 0: rename `tmp` to `final`, point `latest` at it (the staged latest.tmp), prune."""
    root, replaced = final.parent, None
    if final.exists():  # this step was saved before (a run with checkpoint.resume=false, or a killed one)
        replaced = final.with_name(final.name + ".replaced")  # still found through `latest` until the new one is in
        if replaced.exists():
            shutil.rmtree(replaced)
        os.rename(final, replaced)
    os.rename(tmp, final)
    _fsync_dir(root)
    os.replace(root / (LATEST + ".tmp"), root / LATEST)
    _fsync_dir(root)
    if replaced is not None:
        shutil.rmtree(replaced)
    if keep_last is not None:
        prune(root, keep_last)


def _write_rank_files(state, tmp: Path, fmt: str) -> None:
    """This rank's part of the checkpoint in `tmp`: the format's files (dist_checkpointing: collective) and its RNG
    file. A failure here is a save error (the seam the tests make fail)."""
    rank = dist.get_rank()
    if fmt == FORMAT_FSDP:  # each rank its own shards, nothing collective
        (tmp / FSDP_DIR).mkdir(exist_ok=True)
        _save_file(_fsdp_rank_state(state), tmp / FSDP_DIR / f"rank{rank:05d}.pt")
    else:
        from megatron.core import dist_checkpointing

        with blocked_in_children():  # the writer's helper process, started on the first save, ignores stop signals
            dist_checkpointing.save(_sharded_state_dict(state, is_loading=False), str(tmp))
    (tmp / "rng").mkdir(exist_ok=True)
    torch.save(_rng_state(), tmp / "rng" / f"rank{rank:05d}.pt")


def prune(root: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` complete checkpoints (never the one `latest` names)."""
    latest = (root / LATEST).read_text().strip() if (root / LATEST).is_file() else None
    removed = [p for p in sources.complete_checkpoints(root)[keep_last:] if p.name != latest]  # newest first
    for p in removed:
        shutil.rmtree(p)
    return removed


def remove_checkpoints(root: Path, names: list[str]) -> None:
    """Delete the named complete checkpoints of `root` (checkpoint.overwrite=true: an earlier run's), never the one
    `latest` names."""
    latest = (root / LATEST).read_text().strip() if (root / LATEST).is_file() else None
    complete = {p.name for p in sources.complete_checkpoints(root)}
    for name in names:
        if name != latest and name in complete:
            shutil.rmtree(root / name)


def load_checkpoint(state, ckpt: Path) -> dict:
    """Load `ckpt` into `state` (model, optimizer, schedule, RNG if same layout); returns its metadata."""
    _resume_notes(state, ckpt)
    meta = read_meta(ckpt)
    rope_note = check_compatible(meta, state.meta(), ckpt)
    check_format(meta, state, ckpt)
    if rope_note is not None:
        state.notes.append(rope_note)
    rng = _read_rng_file(state, ckpt, meta)  # before any tensor is loaded; every rank agrees on refusing
    if checkpoint_format(state) == FORMAT_FSDP:
        _load_fsdp(state, ckpt)
    else:
        from megatron.core import dist_checkpointing

        loaded = dist_checkpointing.load(_sharded_state_dict(state, is_loading=True), str(ckpt))
        state.model.load_state_dict(loaded["model"], strict=True)
        state.optimizer.load_state_dict(loaded["optimizer"])
        state.scheduler.load_state_dict(loaded["scheduler"])
    if rng is not None:
        _set_rng_state(rng)
    return meta
