"""The per-rank checkpoint format of Megatron-FSDP runs ("fsdp_per_rank", see checkpointing.py, Formats): what this
rank owns as one file fsdp/rankNNNNN.pt, and loading it back into a run of the same layout, with every rank's
verdict agreed before any tensor is copied (also the model buffers alone, for tools/convert_hf_llama.py)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from megatron_upipe.checkpoint.sources import CheckpointError
from megatron_upipe.memory_switches.sharding import local_part, zero_buffer_padding
from megatron_upipe.training.agree import largest_on_any_rank
from megatron_upipe.training.checkpoint_compat import FORMAT_FSDP
from megatron_upipe.training.checkpoint_files import load_own_file

FSDP_DIR = "fsdp"
_FSDP_BUFFERS = ("model_weight_buffer", "main_weight_buffer", "transpose_weight_buffer")


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
    """What this rank owns under Megatron-FSDP, as local CPU tensors (see checkpointing.py, Formats)."""
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
                              "device"), _portable(local_part(v))) if torch.is_tensor(v) else ("value", v))
                        for k, v in inner.state[p].items()}
        scaler = getattr(opt, "grad_scaler", None)
        optimizers.append({"param_groups": groups, "state": adam,
                           "grad_scaler": scaler.state_dict() if scaler is not None else None})
    return {"format": FORMAT_FSDP, "rank": dist.get_rank(), "world_size": dist.get_world_size(),
            "buffers": buffers, "optimizers": optimizers, "scheduler": state.scheduler.state_dict()}


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
                    if match(f"Adam {key} of {name}", local_part(t), value):
                        new[key] = (t, value)
                elif kind == "value":
                    new[key] = (None, value)
                else:
                    new[key] = (None, value.to(local_part(p).device) if kind == "device" else value.clone())
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
    if largest_on_any_rank([len(problems)], device)[0]:  # every rank reaches the same verdict before any copy
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
                    local_part(t).copy_(value)
                    value = t
                st[key] = value
            inner.state[p] = st
        elif action[0] == "scaler" and action[2] is not None:
            action[1].grad_scaler.load_state_dict(action[2])
    zero_buffer_padding(state.ddp)  # a checkpoint saved before the padding was zeroed holds allocator leftovers there
    # A parameter bucket still gathered from the old weights would be used as is by the next forward: release it.
    pipeline = getattr(getattr(state.ddp, "module", None), "all_gather_pipeline", None)
    if pipeline is not None and any(s.name in ("READY_TO_USE", "COMMUNICATING")
                                    for s in pipeline.bucket_status.values()):
        pipeline.reset()
    state.scheduler.load_state_dict(saved["scheduler"])
