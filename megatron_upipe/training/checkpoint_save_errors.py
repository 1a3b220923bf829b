"""Why a save cannot go ahead, in one line: the free-space check before anything is written (the checkpoint's
expected size against its filesystem's free space) and the ranks' write errors after (checkpointing.py, Save
errors)."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from pathlib import Path

import torch
from torch.distributed.checkpoint import CheckpointException  # dist_checkpointing's, on every rank, when a rank failed

from megatron_upipe.checkpoint import sources
from megatron_upipe.memory_switches.sharding import local_part
from megatron_upipe.training.checkpoint_compat import FORMAT_FSDP
from megatron_upipe.training.fsdp_checkpoint import _optimizers


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
                t = local_part(t)
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
