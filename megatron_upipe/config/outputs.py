"""Where a run writes: checkpoint.dir, log.metrics_file, log.tensorboard_dir and the data index cache.

`check_outputs(config)` refuses, before any process group or model, a place the run could not write to, so the
failure does not come at the first save or log line after minutes (or hours) of training. Writability is probed by
creating and removing a small file in the directory itself, or, for one that does not exist yet, in its nearest
existing parent (nothing else is created): os.access alone misjudges read-only mounts, ACLs and root-squashed network
file systems. `dir_problem` / `file_problem` are the probes, also used by the tools for their output options.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from .schema import Config
from .validate import raise_all


def _probe(directory: Path) -> str | None:
    """Why no file can be created in the existing `directory`, or None (the probe file is removed at once)."""
    try:
        fd, name = tempfile.mkstemp(dir=directory, prefix=".write_probe_")
    except OSError as e:
        return e.strerror or str(e)
    os.close(fd)
    os.unlink(name)
    return None


def dir_problem(path: str | os.PathLike) -> str | None:
    """Why files cannot be written in directory `path` (to be created with its parents if missing), or None."""
    p = Path(path)
    try:
        if p.exists() and not p.is_dir():
            return f"{p} is a file, not a directory"
        parent = p
        while not parent.exists():  # the nearest existing parent ("." or "/" at the latest)
            parent = parent.parent
    except OSError as e:  # a parent that cannot be searched
        return f"{p} cannot be reached ({e.strerror or e})"
    if not parent.is_dir():
        return f"{p} cannot be created: {parent} is a file"
    reason = _probe(parent)
    if reason is None:
        return None
    return (f"cannot write in {p}" if parent == p else f"{p} cannot be created in {parent}") + f" ({reason})"


def file_problem(path: str | os.PathLike, make_dir: bool = True) -> str | None:
    """Why file `path` cannot be written (created, or appended to), or None. make_dir: its directory is created if
    missing (as the trainer does); else a missing directory is the problem (a tool writing one file)."""
    p = Path(path)
    try:
        if p.is_dir():
            return f"{p} is a directory"
        if p.exists():
            with open(p, "ab"):  # opening for append changes nothing
                return None
        if not make_dir and not p.parent.is_dir():
            return f"directory {p.parent} does not exist"
    except OSError as e:
        return f"{p} is not writable ({e.strerror or e})"
    return dir_problem(p.parent)


def cache_dir_of(config: Config) -> tuple[Path, str | None]:
    """The data index cache directory and the setting it follows (the rule of training/data.py's `cache_dir`)."""
    c, log = config.checkpoint, config.log
    setting = "checkpoint.dir" if c.dir else "log.metrics_file" if log.metrics_file else None
    anchor = c.dir or log.metrics_file
    return (Path(anchor).parent if anchor else Path("runs")) / "data_cache", setting


def check_outputs(config: Config) -> None:
    """Every place the run writes can be written (checked at start-up and by --dry-run, before anything is built)."""
    c, log = config.checkpoint, config.log
    problems, failed = [], set()
    checks = [("checkpoint.dir", c.dir, dir_problem, "a writable directory, or checkpoint.dir=null (no checkpoints)"),
              ("log.metrics_file", log.metrics_file, file_problem,
               "a file path in a writable directory (e.g. runs/NAME/metrics.jsonl), or log.metrics_file=null"),
              ("log.tensorboard_dir", log.tensorboard_dir, dir_problem,
               "a writable directory, or log.tensorboard_dir=null")]
    for setting, value, probe, give in checks:
        reason = probe(value) if value is not None else None
        if reason:
            problems.append(f"{setting}={value}: {reason}: give {give}")
            failed.add(setting)
    cache, anchor = cache_dir_of(config)
    reason = dir_problem(cache) if anchor not in failed else None
    if reason:
        where = f"next to {anchor}" if anchor else "neither checkpoint.dir nor log.metrics_file is set"
        fix = f"point {anchor} at a writable place" if anchor else "set checkpoint.dir to a writable directory"
        problems.append(f"the data index cache {cache} ({where}): {reason}: {fix}")
    if problems:
        raise_all(problems, "the places this configuration writes:")
