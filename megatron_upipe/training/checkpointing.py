"""Checkpoints: megatron-core dist_checkpointing (resumable into any parallel layout), or, for fully sharded model
states, one file of local shards per rank (same layout only); both written atomically.

Layout of `checkpoint.dir`:
    iter_0000025/            one complete checkpoint (the format's files + the two below)
        train_state.json     step, consumed samples, model shape, tokenizer fingerprint, layout, config, format
        rng/rank00000.pt     each rank's RNG states (torch, CUDA, megatron's tracker, python, numpy)
    latest                   the name of the newest complete checkpoint ("iter_0000025")
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

Atomic save: all ranks write into `iter_XXXXXXX.tmp`; after a barrier (every rank finished), rank 0 writes
train_state.json, renames the directory to `iter_XXXXXXX` and then replaces `latest` (write-temp, fsync,
os.replace). A process killed at any point leaves `latest` naming the previous complete checkpoint. keep_last then
prunes the oldest complete checkpoints (never the one `latest` names).

Resume: `find_checkpoint(path)` accepts a checkpoint directory or a run directory holding `latest`. Before loading
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
import json
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megatron_upipe.checkpoint.sources import LATEST, CheckpointError, compare_models, find_checkpoint
from megatron_upipe.checkpoint.sources import TRAIN_META as META
from megatron_upipe.training.signals import blocked_in_children

FORMAT_DIST = "dist_checkpointing"  # also what a checkpoint without a "format" field is
FORMAT_FSDP = "fsdp_per_rank"
FSDP_DIR = "fsdp"
_FSDP_LAYOUT = ("tp", "pp", "cp", "dp")  # what fixes Megatron-FSDP's buffer slicing (with the model and precision)
_FSDP_BUFFERS = ("model_weight_buffer", "main_weight_buffer", "transpose_weight_buffer")
_ITER = re.compile(r"^iter_(\d{7,})$")


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
        saved = torch.load(path, map_location="cpu", weights_only=False)
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
    """Save `state` (a TrainState) as `root/iter_<step>`; every rank calls it. Returns the checkpoint path.
    `before_publish(tmp_dir)` runs on rank 0 after all shards are written and before the rename (tests)."""
    root, rank = Path(root), dist.get_rank()
    fmt = checkpoint_format(state)
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
    if fmt == FORMAT_FSDP:  # each rank its own shards, nothing collective
        (tmp / FSDP_DIR).mkdir(exist_ok=True)
        _save_file(_fsdp_rank_state(state), tmp / FSDP_DIR / f"rank{rank:05d}.pt")
    else:
        from megatron.core import dist_checkpointing

        with blocked_in_children():  # the writer's helper process, started on the first save, ignores stop signals
            dist_checkpointing.save(_sharded_state_dict(state, is_loading=False), str(tmp))
    (tmp / "rng").mkdir(exist_ok=True)
    torch.save(_rng_state(), tmp / "rng" / f"rank{rank:05d}.pt")
    dist.barrier()  # every rank's shards and RNG file are on disk
    if rank == 0:
        (tmp / META).write_text(json.dumps({**state.meta(), "format": fmt}, indent=2))
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
    meta = read_meta(ckpt)
    rope_note = check_compatible(meta, state.meta(), ckpt)
    check_format(meta, state, ckpt)
    if rope_note is not None:
        state.notes.append(rope_note)
    if checkpoint_format(state) == FORMAT_FSDP:
        _load_fsdp(state, ckpt)
    else:
        from megatron.core import dist_checkpointing

        loaded = dist_checkpointing.load(_sharded_state_dict(state, is_loading=True), str(ckpt))
        state.model.load_state_dict(loaded["model"], strict=True)
        state.optimizer.load_state_dict(loaded["optimizer"])
        state.scheduler.load_state_dict(loaded["scheduler"])
    rng_file = ckpt / "rng" / f"rank{dist.get_rank():05d}.pt"
    if meta["layout"] == dataclasses.asdict(state.groups.layout) and rng_file.is_file():
        _set_rng_state(torch.load(rng_file, weights_only=False))
    return meta
