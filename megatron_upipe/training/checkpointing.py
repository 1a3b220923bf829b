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
  memory_stack/sharding.py): `fsdp/rank00000.pt` ... one torch.save file per rank holding exactly what that rank
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
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import CheckpointException  # dist_checkpointing's, on every rank, when a rank failed

from megatron_upipe.checkpoint import sources
from megatron_upipe.checkpoint.sources import FILE_PROBLEMS, LATEST, MANIFEST, CheckpointError, compare_models
from megatron_upipe.checkpoint.sources import find_checkpoint  # noqa: F401 (named here by training code and tests)
from megatron_upipe.checkpoint.sources import TRAIN_META as META
from megatron_upipe.training.signals import blocked_in_children

FORMAT_DIST = "dist_checkpointing"  # also what a checkpoint without a "format" field is
FORMAT_FSDP = "fsdp_per_rank"
FSDP_DIR = "fsdp"
_FSDP_LAYOUT = ("tp", "pp", "cp", "dp")  # what fixes Megatron-FSDP's buffer slicing (with the model and precision)
_FSDP_BUFFERS = ("model_weight_buffer", "main_weight_buffer", "transpose_weight_buffer")
_ITER = re.compile(r"^iter_(\d{7,})$")
_RANK_FILE = re.compile(r"^(?:__(\d+)_\d+\.distcp|(?:fsdp|rng)/rank(\d{5})\.pt)$")  # written by one rank each
_NO_PROBLEM = 2 ** 62  # verify_checkpoint's code for "every file matches"
EXIT_SAVE_FAILED = 6  # pretrain_llama.py's exit status when a checkpoint could not be saved


class SaveFailed(Exception):
    """A checkpoint could not be saved (too little free space, or the writer failed on some rank): nothing was
    published, the partial save is removed, `latest` names the previous checkpoint. Every rank raises it with the same
    one-line message."""


class ResumePoint(type(Path())):
    """The checkpoint a resume loads, with what its lookup found on the way: `skipped` (one line per checkpoint passed
    over as corrupt, or a `latest` naming nothing) and `unverified` (saved without a manifest). load_checkpoint reads
    them (checkpoint.on_corrupt)."""

    skipped: tuple[str, ...] = ()
    unverified: bool = False


def checkpoint_name(step: int) -> str:
    return f"iter_{step:07d}"


def read_meta(ckpt: Path) -> dict:
    return json.loads((ckpt / META).read_text())


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


# What an RNG file of an earlier version holds besides tensors and plain values: numpy's state array. Allowed by
# name for weights_only loading; files written now hold a tensor instead (`_rng_state`).
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


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _portable(t: torch.Tensor) -> torch.Tensor:
    """`t` detached on the CPU, as a tensor that owns its storage (torch.save writes a view's whole storage)."""
    t = t.detach().cpu()
    if t.storage_offset() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()
    return t


def _simple(v) -> bool:
    if isinstance(v, (list, tuple)):
        return all(map(_simple, v))
    return v is None or isinstance(v, (bool, int, float, str))


def _optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _fsdp_parts(state):
    """(Megatron-FSDP's param_and_grad_buffer, {id(optimizer parameter): name})."""
    pgb = getattr(state.ddp, "param_and_grad_buffer", None)
    if pgb is None:
        raise CheckpointError(f"memory.shard_model_states=true but the wrapped model ({type(state.ddp).__name__}) "
                              f"is not Megatron-FSDP's")
    return pgb, {id(p): name for name, p in pgb.optimizer_named_parameters}


def _fsdp_rank_state(state) -> dict:
    """What this rank owns under Megatron-FSDP, as local CPU tensors (see the module docstring)."""
    from torch.distributed.tensor import DTensor

    pgb, names = _fsdp_parts(state)
    buffers = []
    for group in pgb.parameter_groups:
        bufs = {}
        for attr in _FSDP_BUFFERS:
            buf = getattr(group, attr, None)
            if buf is not None and getattr(buf, "data", None) is not None:
                bufs[attr] = _portable(buf.data)
        buffers.append(bufs)
    optimizers = []
    for opt in _optimizers(state.optimizer):
        inner = opt.optimizer
        groups, adam = [], {}
        for group in inner.param_groups:
            params = [names[id(p)] for p in group["params"]]
            groups.append({"params": params, **{k: v for k, v in group.items() if k != "params" and _simple(v)}})
            for name, p in zip(params, group["params"]):
                if inner.state.get(p):
                    adam[name] = {
                        k: ((("dtensor" if isinstance(v, DTensor) else "cpu" if v.device.type == "cpu" else
                              "device"), _portable(_local(v))) if torch.is_tensor(v) else ("value", v))
                        for k, v in inner.state[p].items()}
        scaler = getattr(opt, "grad_scaler", None)
        optimizers.append({"param_groups": groups, "state": adam,
                           "grad_scaler": scaler.state_dict() if scaler is not None else None})
    return {"format": FORMAT_FSDP, "rank": dist.get_rank(), "world_size": dist.get_world_size(),
            "buffers": buffers, "optimizers": optimizers, "scheduler": state.scheduler.state_dict()}


def _save_file(obj, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _match(problems: list[str], what: str, have: torch.Tensor, got: torch.Tensor) -> bool:
    if tuple(have.shape) != tuple(got.shape) or have.dtype != got.dtype:
        problems.append(f"{what}: checkpoint {tuple(got.shape)} {got.dtype} != run {tuple(have.shape)} {have.dtype}")
        return False
    return True


def _plan_buffers(pgb, saved: dict, problems: list[str]) -> list:
    """Copy actions for this rank's saved Megatron-FSDP buffer shards into the run's (problems appended)."""
    if (saved.get("rank"), saved.get("world_size")) != (dist.get_rank(), dist.get_world_size()):
        problems.append(f"the file is rank {saved.get('rank')} of {saved.get('world_size')}, this is rank "
                        f"{dist.get_rank()} of {dist.get_world_size()}")
    groups, actions = pgb.parameter_groups, []
    if len(saved["buffers"]) != len(groups):
        problems.append(f"{len(saved['buffers'])} Megatron-FSDP parameter groups in the checkpoint, {len(groups)} "
                        f"in the run")
        return actions
    for i, (group, bufs) in enumerate(zip(groups, saved["buffers"])):
        have = {a for a in _FSDP_BUFFERS if getattr(group, a, None) is not None
                and getattr(getattr(group, a), "data", None) is not None}
        if have != set(bufs):
            problems.append(f"parameter group {i}: buffers {sorted(bufs)} in the checkpoint, {sorted(have)} in "
                            f"the run")
            continue
        for attr, t in bufs.items():
            data = getattr(group, attr).data
            if _match(problems, f"parameter group {i} {attr}", data, t):
                actions.append(("copy", data, t))
    return actions


def _fsdp_plan_load(state, saved: dict) -> tuple[list, list[str]]:
    """Match this rank's saved shards with the run's tensors: (copy actions, problems). Reads nothing into the run."""
    pgb, names = _fsdp_parts(state)
    problems: list[str] = []
    actions = _plan_buffers(pgb, saved, problems)
    match = lambda what, have, got: _match(problems, what, have, got)  # noqa: E731
    opts = _optimizers(state.optimizer)
    if len(saved["optimizers"]) != len(opts):
        problems.append(f"{len(saved['optimizers'])} optimizers in the checkpoint, {len(opts)} in the run")
        return actions, problems
    for opt, s in zip(opts, saved["optimizers"]):
        inner = opt.optimizer
        if [[names.get(id(p)) for p in g["params"]] for g in inner.param_groups] != \
                [g["params"] for g in s["param_groups"]]:
            problems.append("the optimizer's parameter groups differ (names or order)")
            continue
        for group, g in zip(inner.param_groups, s["param_groups"]):
            actions.append(("group", group, {k: v for k, v in g.items() if k != "params"}))
        by_name = {names[id(p)]: p for g in inner.param_groups for p in g["params"]}
        for name, entries in s["state"].items():
            p = by_name[name]
            new = {}
            for key, (kind, value) in entries.items():
                if kind == "dtensor":
                    t = torch.zeros_like(p)  # a DTensor laid out like the parameter, as Adam makes its moments
                    if match(f"Adam {key} of {name}", _local(t), value):
                        new[key] = (t, value)
                elif kind == "value":
                    new[key] = (None, value)
                else:
                    new[key] = (None, value.to(_local(p).device) if kind == "device" else value.clone())
            actions.append(("adam", inner, p, new))
        actions.append(("scaler", opt, s["grad_scaler"]))
    return actions, problems


def _read_rank_file(ckpt: Path, plan, device) -> tuple[dict | None, list]:
    """This rank's fsdp/rankNNNNN.pt and `plan(saved) -> (actions, problems)`, with every rank's verdict agreed
    (all_reduce) before any copy; CheckpointError when any rank has a problem."""
    path = ckpt / FSDP_DIR / f"rank{dist.get_rank():05d}.pt"
    if path.is_file():
        saved = load_own_file(path)
        actions, problems = plan(saved)
    else:
        saved, actions, problems = None, [], [f"{path} is missing"]
    bad = torch.tensor([len(problems)], dtype=torch.int64, device=device)
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)  # every rank reaches the same verdict before any copy
    if bad.item():
        raise CheckpointError(f"checkpoint {ckpt} ({FORMAT_FSDP}) does not fit this run's fully sharded states; "
                              f"refusing to load it:\n- " + ("\n- ".join(problems) if problems else
                                                              "another rank's shards differ (see its message)"))
    return saved, actions


@torch.no_grad()
def load_fsdp_model_buffers(ddp, ckpt: Path, device=torch.device("cpu")) -> None:
    """The model part only of a per-rank FSDP checkpoint (compute and fp32 main parameter shards) into a
    Megatron-FSDP-wrapped stage of the same layout (tools/convert_hf_llama.py mcore-to-hf); every rank calls it."""
    pgb = ddp.param_and_grad_buffer

    def plan(saved):
        problems: list[str] = []
        return _plan_buffers(pgb, saved, problems), problems

    _, actions = _read_rank_file(ckpt, plan, device)
    for _, data, t in actions:
        data.copy_(t)


@torch.no_grad()
def _load_fsdp(state, ckpt: Path) -> None:
    """Load this rank's file of a per-rank FSDP checkpoint (layout already checked); every rank calls it."""
    saved, actions = _read_rank_file(ckpt, lambda saved: _fsdp_plan_load(state, saved), state.groups.device)
    for action in actions:
        if action[0] == "copy":
            action[1].copy_(action[2])
        elif action[0] == "group":
            action[1].update(action[2])
        elif action[0] == "adam":
            _, inner, p, new = action
            st = {}
            for key, (t, value) in new.items():
                if t is not None:
                    _local(t).copy_(value)
                    value = t
                st[key] = value
            inner.state[p] = st
        elif action[0] == "scaler" and action[2] is not None:
            action[1].grad_scaler.load_state_dict(action[2])
    from megatron_upipe.memory_stack.sharding import zero_buffer_padding

    zero_buffer_padding(state.ddp)  # a checkpoint saved before the padding was zeroed holds allocator leftovers there
    # A parameter bucket still gathered from the old weights would be used as is by the next forward: release it.
    pipeline = getattr(getattr(state.ddp, "module", None), "all_gather_pipeline", None)
    if pipeline is not None and any(s.name in ("READY_TO_USE", "COMMUNICATING")
                                    for s in pipeline.bucket_status.values()):
        pipeline.reset()
    state.scheduler.load_state_dict(saved["scheduler"])


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
            _write_synced(tmp / MANIFEST, json.dumps({"checksum": "crc32", "total_bytes": sum(
                e["bytes"] for e in files.values()), "files": dict(sorted(files.items()))}, indent=1))
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


def _own_files(tmp: Path, rank: int, world: int) -> list[str]:
    """The files of `tmp` this rank checksums for the manifest: the ones it wrote (torch_dist's __<rank>_<n>.distcp,
    its fsdp/ and rng/ files); rank 0 also those no rank owns by name (.metadata, metadata.json, common.pt)."""
    mine = [rel for rel in (f"{FSDP_DIR}/rank{rank:05d}.pt", f"rng/rank{rank:05d}.pt") if (tmp / rel).is_file()]
    n = 0
    while (tmp / f"__{rank}_{n}.distcp").is_file():
        mine.append(f"__{rank}_{n}.distcp")
        n += 1
    if rank == 0:  # every rank's data files are complete here (dist_checkpointing wrote .metadata after them)
        for path in sorted(tmp.rglob("*")):
            rel = path.relative_to(tmp).as_posix()
            owned = _RANK_FILE.match(rel)
            if path.is_file() and rel not in (META, MANIFEST) and not (
                    owned and int(owned.group(1) or owned.group(2)) < world):
                mine.append(rel)
    return mine


def _entry(path: Path) -> dict:
    size, crc = sources.crc32_file(path)
    return {"bytes": size, "crc32": crc}


def _from_rank0(value):
    """Rank 0's `value` on every rank (one broadcast)."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


def _error_line(e: BaseException, rank: int) -> str:
    if isinstance(e, CheckpointException) and getattr(e, "failures", None):  # {rank: (exception, traceback)}
        failed, (exc, *_) = next(iter(sorted(e.failures.items(), key=lambda kv: kv[0])))
        return f"rank {failed}: {type(exc).__name__}: {_one_line(str(exc))}"
    return f"rank {rank}: {type(e).__name__}: {_one_line(str(e))}"


def _write_failure(root: Path, errors: list[str]) -> str | None:
    """Rank 0: one line for the ranks' write errors (None without any), with the free space after a full disk."""
    if not errors:
        return None
    line = errors[0] + (f" (and {len(errors) - 1} more rank(s))" if len(errors) > 1 else "")
    if os.strerror(errno.ENOSPC) in line:
        line += f"; {_filesystem(root)} has {_gib(shutil.disk_usage(root).free)} free"
    return "writing it failed: " + line


def _not_saved(final: Path, why: str) -> str:
    latest = sources.latest_target(final.parent)
    return (f"checkpoint {final} not saved: {why}; nothing was published (no partial {final.name}.tmp is left), "
            f"`latest` " + (f"still names {latest.name}" if latest is not None else "names no checkpoint"))


def _gib(n: int) -> str:
    return f"{n / 2 ** 30:.3g} GiB"


def _filesystem(path: Path) -> str:
    """'<device> (mounted on <mount point>)' of the filesystem holding `path` (/proc/self/mounts), else the path."""
    real, device, mount = os.path.realpath(path), None, ""
    with contextlib.suppress(OSError), open("/proc/self/mounts", encoding="utf-8") as f:
        for line in f:
            fields = line.split()
            if len(fields) < 2:
                continue
            at = fields[1].replace("\\040", " ")
            if (real == at or real.startswith(at.rstrip("/") + "/")) and len(at) >= len(mount):
                device, mount = fields[0], at
    return f"{device} (mounted on {mount})" if device else str(path)


def _checkpoint_bytes(ckpt: Path) -> int:
    """A complete checkpoint's size: its manifest's total, else the sum of its files' sizes."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        manifest = sources.read_manifest(ckpt)
        if manifest is not None:
            return int(manifest["total_bytes"])
    return sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())


def _space_refusal(root: Path, previous: Path | None, estimate: int) -> str | None:
    """Rank 0, before writing: one line when the free space of `root`'s filesystem is less than the checkpoint
    needs (the size of `previous`, the newest complete checkpoint, else `estimate`); None when it fits."""
    if previous is not None:
        need, basis = _checkpoint_bytes(previous), f"the size of {previous.name}"
    else:
        need, basis = estimate, "the model and optimizer states of all ranks"
    free = shutil.disk_usage(root).free
    if free >= need:
        return None
    return f"no space left on {_filesystem(root)}: need {_gib(need)} ({basis}), have {_gib(free)} free in {root}"


def _state_bytes(state, fmt: str) -> int:
    """This rank's share of the checkpoint's tensor bytes (model parameters, optimizer parameters and states):
    fully sharded states count on every rank; in the dist_checkpointing format a replica over dp x cp counts once
    (on its rank 0), except ZeRO-1's optimizer shards (train.distributed_optimizer), which count on every rank."""
    sizes: dict[tuple, int] = {}

    def add(tensors) -> None:
        for t in tensors:
            if torch.is_tensor(t):
                t = _local(t)
                sizes[(t.data_ptr(), t.numel(), t.dtype)] = t.numel() * t.element_size()

    sharded = fmt == FORMAT_FSDP
    first_replica = sharded or state.groups.pg.dp_cp.rank() == 0
    if first_replica:
        add(state.model.parameters())
    if first_replica or state.config.train.distributed_optimizer:
        for opt in _optimizers(state.optimizer):
            inner = getattr(opt, "optimizer", opt)
            add(p for group in inner.param_groups for p in group["params"])
            add(v for st in inner.state.values() for v in st.values())
    return sum(sizes.values())


def prune(root: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` complete checkpoints (never the one `latest` names)."""
    latest = (root / LATEST).read_text().strip() if (root / LATEST).is_file() else None
    done = sorted((p for p in root.iterdir() if _ITER.match(p.name) and (p / META).is_file()),
                  key=lambda p: int(_ITER.match(p.name).group(1)))
    removed = [p for p in done[:-keep_last] if p.name != latest]
    for p in removed:
        shutil.rmtree(p)
    return removed


def remove_checkpoints(root: Path, names: list[str]) -> None:
    """Delete the named complete checkpoints of `root` (checkpoint.overwrite=true: an earlier run's), never the one
    `latest` names."""
    latest = (root / LATEST).read_text().strip() if (root / LATEST).is_file() else None
    for name in names:
        if name != latest and _ITER.match(name) and (root / name).is_dir():
            shutil.rmtree(root / name)


def resume_checkpoint(root: str | Path, device: torch.device | None = None) -> ResumePoint | None:
    """Every rank: the checkpoint of run directory `root` to resume from, the one `latest` names or, when that one
    is corrupt or `latest` names nothing, the newest intact complete one, each verified against its manifest
    (`verify_checkpoint`) before any tensor is read; what was skipped and why travels with it (ResumePoint). None
    without a `latest` (nothing published yet); CheckpointError when no checkpoint is intact."""
    device = device if device is not None else _collective_device()
    candidates, latest_problem = _from_rank0(sources.resume_candidates(root))  # every rank tries the same ones
    skipped = [latest_problem] if latest_problem else []
    if not candidates:
        if latest_problem:
            raise CheckpointError(latest_problem)
        return None
    for ckpt in candidates:
        problem, has_manifest = verify_checkpoint(ckpt, device)
        if problem is None:
            found = ResumePoint(ckpt)
            found.skipped, found.unverified = tuple(skipped), not has_manifest
            return found
        skipped.append(problem)
    raise CheckpointError(f"no intact checkpoint in {root}: " + "; ".join(skipped))


def verify_checkpoint(ckpt: Path, device: torch.device) -> tuple[str | None, bool]:
    """Every rank: (one line naming the first file of `ckpt` that differs from its manifest, None when all match;
    whether it has a manifest). The files are dealt out over the ranks, largest first, and each rank reads its own
    share; one all-reduce (MIN over the first problem's index) gives every rank the same verdict. train_state.json
    and the manifest must be readable; a checkpoint without a manifest (saved before manifests) passes unverified."""
    rank, world = dist.get_rank(), dist.get_world_size()
    code, manifest, names, sizes = _NO_PROBLEM, None, [], []
    try:
        json.loads((ckpt / META).read_text())
    except (OSError, ValueError):
        code = 0
    try:
        manifest = sources.read_manifest(ckpt)
        names = sorted(manifest["files"]) if manifest is not None else []
        sizes = [int(manifest["files"][n]["bytes"]) for n in names]
    except (OSError, ValueError, KeyError, TypeError):
        code, manifest, names, sizes = min(code, 1), {}, [], []  # {}: it exists, but is no manifest
    by_size = sorted(range(len(names)), key=lambda i: (-sizes[i], i))
    for i in sorted(by_size[rank::world]):
        problem = sources.file_problem(ckpt, names[i], manifest["files"][names[i]])
        if problem is not None:
            code = 2 + i * len(FILE_PROBLEMS) + FILE_PROBLEMS.index(problem)
            break
    verdict = torch.tensor([code, int(manifest is not None)], dtype=torch.int64, device=device)
    dist.all_reduce(verdict, op=dist.ReduceOp.MIN)
    code, has_manifest = verdict.tolist()
    if code == _NO_PROBLEM:
        return None, bool(has_manifest)
    if code == 0:
        what = f"{ckpt / META} cannot be read"
    elif code == 1:
        what = f"{ckpt / MANIFEST} is not a readable manifest"
    else:
        i, kind = divmod(code - 2, len(FILE_PROBLEMS))
        files = manifest["files"] if names else sources.read_manifest(ckpt)["files"]  # another rank found it
        what = sources.describe_file_problem(ckpt, sorted(files)[i], files[sorted(files)[i]], FILE_PROBLEMS[kind])
    return f"checkpoint {ckpt} is corrupt: {what}", bool(has_manifest)


def _collective_device() -> torch.device:
    """Where this process group reduces tensors (NCCL: the current GPU)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _resume_notes(state, ckpt: Path) -> None:
    """What the resume lookup found on the way (a ResumePoint): with checkpoint.on_corrupt=stop a skipped checkpoint
    is refused (CheckpointError, one line); otherwise warning lines for the run's log."""
    skipped = getattr(ckpt, "skipped", ())
    if skipped and state.config.checkpoint.on_corrupt == "stop":
        raise CheckpointError("; ".join(skipped) + f"; refusing to resume from an older checkpoint "
                              f"(checkpoint.on_corrupt=stop): remove or repair it, or set "
                              f"checkpoint.on_corrupt=fallback to resume from {ckpt.name}, the newest intact one")
    if skipped:
        state.notes.append("warning: skipped: " + "; ".join(skipped) + f"; resuming from {ckpt}, the newest intact "
                           f"checkpoint (checkpoint.on_corrupt=fallback)")
    if getattr(ckpt, "unverified", False):
        state.notes.append(f"{ckpt} has no {MANIFEST} (saved by an earlier version): its files' sizes and checksums "
                           f"are unknown, so it is loaded unverified")


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
    bad = torch.tensor([problem is not None], dtype=torch.int64, device=state.groups.device)
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    if bad.item():
        raise problem or CheckpointError(f"checkpoint {ckpt}: another rank's RNG file is not plain data (see its "
                                         f"message); refusing to load it")
    return rng
