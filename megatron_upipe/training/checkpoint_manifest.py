"""The manifest (manifest.json: every file's size and CRC-32, and their total): which files each rank checksums for it
at save, and the resume lookup that verifies a checkpoint against it before any tensor is read, falling back past
corrupt checkpoints to the newest intact one (checkpointing.py, Integrity)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_upipe.checkpoint import sources
from megatron_upipe.checkpoint.sources import FILE_PROBLEMS, MANIFEST, CheckpointError
from megatron_upipe.checkpoint.sources import TRAIN_META as META
from megatron_upipe.training.checkpoint_files import _write_synced
from megatron_upipe.training.fsdp_checkpoint import FSDP_DIR

_RANK_FILE = re.compile(r"^(?:__(\d+)_\d+\.distcp|(?:fsdp|rng)/rank(\d{5})\.pt)$")  # written by one rank each
_NO_PROBLEM = 2 ** 62  # verify_checkpoint's code for "every file matches"


class ResumePoint(type(Path())):
    """The checkpoint a resume loads, with what its lookup found on the way: `skipped` (one line per checkpoint passed
    over as corrupt, or a `latest` naming nothing) and `unverified` (saved without a manifest). load_checkpoint reads
    them (checkpoint.on_corrupt)."""

    skipped: tuple[str, ...] = ()
    unverified: bool = False


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


def _write_manifest(tmp: Path, files: dict) -> None:
    """Rank 0: `tmp`/manifest.json (fsynced) from every file's {"bytes", "crc32"} entry, with their total."""
    _write_synced(tmp / MANIFEST, json.dumps({"checksum": "crc32", "total_bytes": sum(
        e["bytes"] for e in files.values()), "files": dict(sorted(files.items()))}, indent=1))


def _from_rank0(value):
    """Rank 0's `value` on every rank (one broadcast)."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


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
