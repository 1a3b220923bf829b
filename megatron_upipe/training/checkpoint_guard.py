"""What keeps a run from destroying another run's checkpoints: the overwrite refusal and the directory lock.

Overwrite: a run that does not resume (`checkpoint.resume=false`) but whose `checkpoint.dir` already holds complete
checkpoints would save its steps over them. `overwrite_refusal(config)` refuses that at start-up and in --dry-run
unless `checkpoint.overwrite=true`; with it, the old checkpoints stay until the new run has published its first
checkpoint, and are then removed (`superseded_checkpoints` lists them at start-up; training/loop.py removes them).

Lock: `checkpoint.dir/LOCK` names the run that holds the directory (host, pid and the pid's start time, Slurm job
id, when). Rank 0 creates it atomically (O_EXCL) at start-up, before anything is read or allocated, and removes it
when the job ends; every rank learns the verdict through one broadcast, so a refused run exits on every rank at
once. A lock left by a run that is gone does not block a resume:
  - same host, and its pid is dead or now another process (its start time differs): stale;
  - the same Slurm job id as this job (a requeued job: Slurm runs one incarnation at a time): stale;
  - another Slurm job that `squeue` no longer lists: stale.
Otherwise the run is refused in one line naming the holder; a lock whose holder cannot be checked from here
(another host, no Slurm) names the file to remove once that run is known to be gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_upipe.checkpoint.sources import LATEST, CheckpointError, complete_checkpoints

LOCK = "LOCK"


def overwrite_refusal(config) -> str | None:
    """One line refusing a fresh run (checkpoint.resume=false) into a checkpoint.dir that holds checkpoints, unless
    checkpoint.overwrite=true; None when nothing would be overwritten."""
    c = config.checkpoint
    if c.dir is None or c.resume is not False or c.overwrite:
        return None
    found = _complete_oldest_first(c.dir)
    if not found and not (Path(c.dir) / LATEST).is_file():
        return None
    shown = ", ".join(found[-3:]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
    return (f"checkpoint.resume=false but checkpoint.dir={c.dir} holds checkpoints ({shown or 'a latest file'}) "
            f"that this run would overwrite: resume them (checkpoint.resume=auto), choose a new checkpoint.dir, or "
            f"set checkpoint.overwrite=true to replace them")


def superseded_checkpoints(config) -> list[str]:
    """With checkpoint.resume=false and checkpoint.overwrite=true: the checkpoints the run replaces (removed once
    its own first checkpoint is published)."""
    c = config.checkpoint
    if c.dir is None or c.resume is not False or not c.overwrite:
        return []
    return _complete_oldest_first(c.dir)


def _complete_oldest_first(root: str) -> list[str]:
    return [p.name for p in reversed(complete_checkpoints(Path(root)))]


def _pid_start(pid: int, proc: Path = Path("/proc")) -> str | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat), None if it does not exist."""
    try:
        stat = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # fields after "(comm)": state is field 3, starttime field 22


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    pid_start: str | None
    slurm_job_id: str | None
    since: float

    @classmethod
    def this_process(cls) -> "Holder":
        return cls(socket.gethostname(), os.getpid(), _pid_start(os.getpid()), os.environ.get("SLURM_JOB_ID"),
                   time.time())

    def words(self) -> str:
        job = f", Slurm job {self.slurm_job_id}" if self.slurm_job_id else ""
        return (f"host {self.host}, pid {self.pid}{job}, since "
                f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.since))}")


def _slurm_job_running(job_id: str) -> bool | None:
    """Whether Slurm still lists `job_id` (None: no squeue here, or it failed)."""
    try:
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return False if "Invalid job id" in out.stderr else None
    return bool(out.stdout.strip())


def is_stale(holder: Holder, me: Holder, slurm_running=_slurm_job_running) -> bool:
    """Whether the run named by a lock is gone (module docstring)."""
    if holder.host == me.host:
        start = _pid_start(holder.pid)
        if start is None or (holder.pid_start is not None and start != holder.pid_start):
            return True
    if holder.slurm_job_id is not None:
        if holder.slurm_job_id == me.slurm_job_id:
            return True
        return slurm_running(holder.slurm_job_id) is False
    return False


class DirLock:
    """`checkpoint.dir/LOCK` held by this process (module docstring); `release()` removes it if still ours."""

    def __init__(self, root: str | Path, me: Holder | None = None, slurm_running=_slurm_job_running):
        self.path = Path(root) / LOCK
        self.me = me or Holder.this_process()
        self.slurm_running = slurm_running
        self.held = False
        self.made_dir = False  # acquire() created checkpoint.dir: release() removes it again if nothing else is there

    def _read(self) -> Holder | None:
        try:
            return Holder(**json.loads(self.path.read_text()))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError):  # unreadable or from an unknown version: held by nobody we know
            return Holder("?", -1, None, None, self.path.stat().st_mtime)

    def acquire(self) -> None:
        """Take the lock or raise CheckpointError naming the holder."""
        self.made_dir = not self.path.parent.exists()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(self.me.__dict__)
        for _ in range(3):  # a stale lock is replaced, then taken again with O_EXCL (two racing runs: one wins)
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._read()
                if holder is None:
                    continue
                if holder.host != "?" and is_stale(holder, self.me, self.slurm_running):
                    self.path.unlink(missing_ok=True)
                    continue
                raise CheckpointError(
                    f"checkpoint.dir={self.path.parent} is in use by another run ({holder.words()}): wait for it to "
                    f"end or use another checkpoint.dir; if that run is gone, remove {self.path}") from None
            with os.fdopen(fd, "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            self.held = True
            return
        raise CheckpointError(f"could not take {self.path}: another run keeps taking it; use another checkpoint.dir")

    def release(self) -> None:
        if self.held:
            holder = self._read()
            if holder is not None and (holder.host, holder.pid) == (self.me.host, self.me.pid):
                self.path.unlink(missing_ok=True)
                if self.made_dir:  # a run refused before its first save leaves no empty checkpoint.dir behind
                    with contextlib.suppress(OSError):
                        self.path.parent.rmdir()
            self.held = False


def acquire_checkpoint_lock(config, rank: int) -> DirLock | None:
    """Collective (every rank calls it after the process group exists): rank 0 takes checkpoint.dir's lock; every
    rank raises the same CheckpointError when it is held. Returns rank 0's DirLock (None elsewhere or without a
    checkpoint.dir); the caller releases it when the job ends."""
    import torch.distributed as dist

    if config.checkpoint.dir is None:
        return None
    lock, verdict = None, [None]
    if rank == 0:
        lock = DirLock(config.checkpoint.dir)
        try:
            lock.acquire()
        except (CheckpointError, OSError) as e:
            verdict = [str(e)]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise CheckpointError(verdict[0])
    return lock
