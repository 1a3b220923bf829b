"""Faults that used to end in tracebacks: a corrupt checkpoint on resume, a disk that fills up during a save.

One 2-rank gloo job runs pretrain_llama.main() many times (tiny Llama, shipped corpus, 64-token sequences):
  base      3 steps, a checkpoint at each (dist_checkpointing): each has a manifest of its files' sizes and CRC-32s;
  distcp    a copy whose newest checkpoint has a truncated __0_0.distcp (checked by rank 0): resumes from step 2
            with one warning line naming the file; metadata: the same with a truncated .metadata, which rank 1
            checks (the verdict reaches rank 0 through the all-reduce);
  stop      the truncated .metadata with checkpoint.on_corrupt=stop: exit 2 on both ranks, one line naming it;
  latest    garbage in `latest`: resumes from the newest complete checkpoint, saying `latest` named nothing;
  old       checkpoints without manifests (an earlier version's) still resume, saying so once;
  none      every checkpoint corrupt: exit 2, one line, no fresh start;
  fsdp      fully sharded states (per-rank files): a truncated fsdp/rank00001.pt falls back the same way;
  nospace   shutil.disk_usage reports 1 KiB free: the save is refused before writing (exit 6, one line with the
            need, the newest checkpoint's size, and the free space), nothing left behind, `latest` unchanged; in a
            fresh directory with checkpoint.on_save_error=continue the need is estimated from the model and
            optimizer states, the run trains on, and its failed final save still ends it (exit 6);
  enospc    the writer raises OSError(ENOSPC) on rank 1 after writing its files (step 2): with
            on_save_error=stop exit 6 and one line naming rank 1's error, the .tmp removed, `latest` on step 1;
            with continue one warning line, the step-3 save succeeds.
Pure functions (file checks, the order of candidates) are tested without processes.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import shutil
from pathlib import Path

import pytest

from tests.dist_helper import run_on_ranks
from tests.train_harness import SMALL, pretrain_error_line, read_metrics, run_main

BASE = [*SMALL, "checkpoint.keep_last=null"]
RESUME = ["checkpoint.save_final=false"]  # resume runs leave the directory as it was
FSDP = ["memory.shard_model_states=true", "parallel.cp=1", "parallel.cp_strategy=none"]  # dp2 on 2 ranks
FREE = 1024  # bytes shutil.disk_usage reports in the no-space cases


def _listing(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name != "LOCK") if root.is_dir() else []


def _latest(root: Path) -> str | None:
    return (root / "latest").read_text().strip() if (root / "latest").is_file() else None


def _job(rank, world_size, tmp):
    import torch.distributed as dist

    from megatron_upipe.training import checkpointing

    tmp = Path(tmp)
    out = {}

    def run(name, *overrides, directory=None):
        stdout = io.StringIO()
        with contextlib.redirect_stdout(stdout):
            code, err = run_main(*BASE, f"checkpoint.dir={tmp / (directory or name)}",
                                 f"log.metrics_file={tmp}/{name}.jsonl", *overrides)
        out[name] = (code, err, stdout.getvalue())

    def on_rank0(fn):
        if rank == 0:
            fn()
        dist.barrier()

    def copy_base(name, corrupt=lambda root: None):
        def do():
            shutil.copytree(tmp / "base", tmp / name)
            corrupt(tmp / name)
        on_rank0(do)

    def truncate(path: Path):
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size // 2)

    run("base", "train.steps=3", "checkpoint.interval=1")
    out["manifest"] = json.loads((tmp / "base" / "iter_0000003" / "manifest.json").read_text())
    out["base_listing"] = _listing(tmp / "base")

    copy_base("distcp", lambda root: truncate(root / "iter_0000003" / "__0_0.distcp"))
    run("distcp", "train.steps=3", *RESUME)
    copy_base("metadata", lambda root: truncate(root / "iter_0000003" / ".metadata"))
    run("metadata", "train.steps=3", *RESUME)
    run("stop", "train.steps=3", "checkpoint.on_corrupt=stop", *RESUME, directory="metadata")
    copy_base("latest", lambda root: (root / "latest").write_bytes(b"\x00\xffiter_00000\n"))
    run("latest", "train.steps=3", *RESUME)
    copy_base("old", lambda root: [p.unlink() for p in root.glob("iter_*/manifest.json")])
    run("old", "train.steps=3", *RESUME)
    copy_base("none", lambda root: [truncate(p) for p in root.glob("iter_*/__0_0.distcp")])
    run("none", "train.steps=3", *RESUME)

    run("fsdp_base", "train.steps=2", "checkpoint.interval=1", *FSDP, directory="fsdp")
    on_rank0(lambda: truncate(tmp / "fsdp" / "iter_0000002" / "fsdp" / "rank00001.pt"))
    run("fsdp", "train.steps=2", *FSDP, *RESUME)

    real_usage = shutil.disk_usage
    shutil.disk_usage = lambda path: real_usage(path)._replace(free=FREE)
    try:
        copy_base("nospace")
        run("nospace", "train.steps=4")
        out["nospace_listing"] = _listing(tmp / "nospace")
        out["nospace_latest"] = _latest(tmp / "nospace")
        run("nospace_fresh", "train.steps=2", "checkpoint.interval=1", "checkpoint.on_save_error=continue")
        out["nospace_fresh_listing"] = _listing(tmp / "nospace_fresh")
    finally:
        shutil.disk_usage = real_usage

    real_write, real_save, seen = checkpointing._write_rank_files, checkpointing.save_checkpoint, {}

    def full_disk_at_step_2(state, tmp_dir, fmt):
        real_write(state, tmp_dir, fmt)
        if state.step == 2 and rank == 1:  # rank 0 wrote everything, rank 1 fails after its own files
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_dir / "rng"))

    def watched_save(state, root, *args, **kw):
        try:
            return real_save(state, root, *args, **kw)
        except checkpointing.SaveFailed:
            seen[(state.config.checkpoint.on_save_error, state.step)] = (_listing(Path(root)), _latest(Path(root)))
            raise

    checkpointing._write_rank_files, checkpointing.save_checkpoint = full_disk_at_step_2, watched_save
    try:
        run("enospc_stop", "train.steps=3", "checkpoint.interval=1")
        run("enospc_continue", "train.steps=3", "checkpoint.interval=1", "checkpoint.on_save_error=continue")
    finally:
        checkpointing._write_rank_files, checkpointing.save_checkpoint = real_write, real_save
    out["enospc_seen"] = seen
    out["enospc_stop_listing"] = _listing(tmp / "enospc_stop")
    out["enospc_continue_listing"] = _listing(tmp / "enospc_continue")
    out["enospc_continue_latest"] = _latest(tmp / "enospc_continue")
    return out


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ckpt_faults")
    return tmp, run_on_ranks(_job, 2, str(tmp))


_one_line = pretrain_error_line


def _ok(out: dict, name: str) -> str:
    code, err, stdout = out[name]
    assert code == 0 and "Traceback" not in err, err
    return stdout


def _warnings(stdout: str) -> list[str]:
    """The run's warning lines about checkpoints (a skipped one, a failed save)."""
    return [line for line in stdout.splitlines() if line.startswith(("warning: skipped:", "warning: step "))]


def test_a_checkpoint_records_its_files_sizes_and_checksums(job):
    tmp, (out, _) = job
    assert _ok(out, "base")
    assert out["base_listing"] == ["iter_0000001", "iter_0000002", "iter_0000003", "latest"]  # nothing staged left
    files = out["manifest"]["files"]
    ckpt = tmp / "base" / "iter_0000003"
    on_disk = sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file() and p.name != "manifest.json")
    assert sorted(files) == on_disk
    assert {"__0_0.distcp", ".metadata", "rng/rank00000.pt", "rng/rank00001.pt", "train_state.json"} <= set(files)
    assert all(files[f]["bytes"] == (ckpt / f).stat().st_size for f in files)
    assert out["manifest"]["total_bytes"] == sum(e["bytes"] for e in files.values())


@pytest.mark.parametrize("name, bad", [("distcp", "__0_0.distcp"), ("metadata", ".metadata")])
def test_a_truncated_file_falls_back_to_the_newest_intact_checkpoint(job, name, bad):
    tmp, per_rank = job
    stdout = _ok(per_rank[0], name)
    _ok(per_rank[1], name)
    [line] = _warnings(stdout)
    assert f"checkpoint {tmp}/{name}/iter_0000003 is corrupt: {tmp}/{name}/iter_0000003/{bad} has " in line, line
    assert "its manifest records" in line and f"resuming from {tmp}/{name}/iter_0000002" in line, line
    assert f"resumed from {tmp}/{name}/iter_0000002 at step 2" in stdout
    assert [r["step"] for r in read_metrics(tmp / f"{name}.jsonl")] == [3]


def test_on_corrupt_stop_refuses_in_one_line_on_every_rank(job):
    tmp, per_rank = job
    lines = []
    for rank, out in enumerate(per_rank):
        code, err, _ = out["stop"]
        assert code == 2, err
        lines.append(_one_line(err).removeprefix(f"pretrain_llama.py: rank {rank}: "))
    assert lines[0] == lines[1]  # rank 1 found it; rank 0 names it too
    assert lines[0].startswith(f"checkpoint {tmp}/metadata/iter_0000003 is corrupt: {tmp}/metadata/iter_0000003/"
                               f".metadata has "), lines[0]
    assert "checkpoint.on_corrupt=stop" in lines[0] and "iter_0000002, the newest intact one" in lines[0]


def test_garbage_in_latest_falls_back_to_the_newest_complete_checkpoint(job):
    tmp, (out, _) = job
    stdout = _ok(out, "latest")
    [line] = _warnings(stdout)
    garbage = repr("\x00\ufffditer_00000")  # the bytes as read (not UTF-8: replaced)
    assert f"{tmp}/latest/latest names {garbage}, which is not a complete checkpoint" in line, line
    assert f"resumed from {tmp}/latest/iter_0000003 at step 3" in stdout


def test_a_checkpoint_without_manifest_still_resumes_saying_so_once(job):
    tmp, (out, _) = job
    stdout = _ok(out, "old")
    assert not _warnings(stdout)
    assert stdout.count("has no manifest.json (saved by an earlier version)") == 1
    assert f"resumed from {tmp}/old/iter_0000003 at step 3" in stdout


def test_no_intact_checkpoint_is_refused_not_a_fresh_start(job):
    tmp, (out, _) = job
    code, err, _ = out["none"]
    assert code == 2
    line = _one_line(err)
    assert f"no intact checkpoint in {tmp}/none: checkpoint {tmp}/none/iter_0000003 is corrupt" in line, line
    assert line.count("is corrupt") == 3
    assert not (tmp / "none.jsonl").exists() or not read_metrics(tmp / "none.jsonl")


def test_a_truncated_per_rank_fsdp_file_falls_back(job):
    tmp, (out, _) = job
    _ok(out, "fsdp_base")
    stdout = _ok(out, "fsdp")
    [line] = _warnings(stdout)
    assert f"{tmp}/fsdp/iter_0000002/fsdp/rank00001.pt has " in line, line
    assert f"resumed from {tmp}/fsdp/iter_0000001 at step 1" in stdout


def test_no_space_is_refused_before_writing(job):
    tmp, per_rank = job
    out = per_rank[0]
    size = out["manifest"]["total_bytes"]
    lines = []
    for rank, o in enumerate(per_rank):
        code, err, _ = o["nospace"]
        assert code == 6, err
        lines.append(_one_line(err).removeprefix(f"pretrain_llama.py: rank {rank}: "))
    assert lines[0] == lines[1]
    assert lines[0].startswith(f"checkpoint {tmp}/nospace/iter_0000004 not saved: no space left on "), lines[0]
    assert (f"need {size / 2 ** 30:.3g} GiB (the size of iter_0000003), have {FREE / 2 ** 30:.3g} GiB free in "
            f"{tmp}/nospace; nothing was published") in lines[0], lines[0]
    assert "`latest` still names iter_0000003; stopped (exit code 6)" in lines[0]
    assert out["nospace_listing"] == ["iter_0000001", "iter_0000002", "iter_0000003", "latest"]
    assert out["nospace_latest"] == "iter_0000003"
    assert [r["step"] for r in read_metrics(tmp / "nospace.jsonl")] == [4]  # the step itself was trained


def test_no_space_with_continue_trains_on_and_a_failed_final_save_stops(job):
    tmp, (out, _) = job
    code, err, stdout = out["nospace_fresh"]
    assert code == 6
    [warning] = _warnings(stdout)
    assert warning.startswith(f"warning: step 1: checkpoint {tmp}/nospace_fresh/iter_0000001 not saved: no space "), \
        warning
    assert "(the model and optimizer states of all ranks)" in warning
    assert "training goes on (checkpoint.on_save_error=continue), the next save is tried at step 2" in warning
    assert f"checkpoint {tmp}/nospace_fresh/iter_0000002 not saved" in _one_line(err)
    assert [r["step"] for r in read_metrics(tmp / "nospace_fresh.jsonl")] == [1, 2]
    assert out["nospace_fresh_listing"] == []  # no checkpoint, no .tmp, no latest


def test_a_full_disk_mid_save_stops_in_one_line_and_cleans_up(job):
    tmp, per_rank = job
    lines = []
    for rank, out in enumerate(per_rank):
        code, err, _ = out["enospc_stop"]
        assert code == 6, err
        lines.append(_one_line(err).removeprefix(f"pretrain_llama.py: rank {rank}: "))
        assert out["enospc_seen"][("stop", 2)] == (["iter_0000001", "latest"], "iter_0000001")
    assert lines[0] == lines[1]
    assert lines[0].startswith(f"checkpoint {tmp}/enospc_stop/iter_0000002 not saved: writing it failed: rank 1: "
                               f"OSError: [Errno 28] No space left on device"), lines[0]
    assert "`latest` still names iter_0000001; stopped (exit code 6)" in lines[0]
    assert per_rank[0]["enospc_stop_listing"] == ["iter_0000001", "latest"]


def test_a_full_disk_mid_save_with_continue_trains_on_and_saves_next_time(job):
    tmp, per_rank = job
    out = per_rank[0]
    stdout = _ok(out, "enospc_continue")
    _ok(per_rank[1], "enospc_continue")
    [warning] = _warnings(stdout)
    assert warning.startswith(f"warning: step 2: checkpoint {tmp}/enospc_continue/iter_0000002 not saved: writing "
                              f"it failed: rank 1: OSError: [Errno 28] No space left on device"), warning
    assert "the next save is tried at step 3" in warning
    assert out["enospc_seen"][("continue", 2)] == (["iter_0000001", "latest"], "iter_0000001")
    assert out["enospc_continue_listing"] == ["iter_0000001", "iter_0000003", "latest"]
    assert out["enospc_continue_latest"] == "iter_0000003"
    assert [r["step"] for r in read_metrics(tmp / "enospc_continue.jsonl")] == [1, 2, 3]


def test_file_checks_and_resume_order(tmp_path):
    from megatron_upipe.checkpoint import sources

    ckpt = tmp_path / "iter_0000002"
    ckpt.mkdir()
    data = os.urandom(3 << 20)
    (ckpt / "a.bin").write_bytes(data)
    size, crc = sources.crc32_file(ckpt / "a.bin")
    import zlib

    entry = {"bytes": size, "crc32": crc}
    assert size == len(data) and crc == zlib.crc32(data)
    assert sources.file_problem(ckpt, "a.bin", entry) is None
    flipped = bytearray(data)
    flipped[12345] ^= 1
    (ckpt / "a.bin").write_bytes(bytes(flipped))
    assert sources.file_problem(ckpt, "a.bin", entry) == "crc32"
    assert "not its CRC-32" in sources.describe_file_problem(ckpt, "a.bin", entry, "crc32")
    (ckpt / "a.bin").write_bytes(data[:100])
    assert sources.file_problem(ckpt, "a.bin", entry) == "size"
    assert sources.file_problem(ckpt, "b.bin", entry) == "missing"

    for step in (1, 2, 3):
        (tmp_path / f"iter_000000{step}").mkdir(exist_ok=True)
        (tmp_path / f"iter_000000{step}" / "train_state.json").write_text("{}")
    (tmp_path / "iter_0000004.tmp").mkdir()  # never published: not a candidate
    assert sources.resume_candidates(tmp_path) == ([], None)  # no `latest`: nothing published
    (tmp_path / "latest").write_text("iter_0000002\n")
    assert sources.resume_candidates(tmp_path) == (
        [tmp_path / "iter_0000002", tmp_path / "iter_0000003", tmp_path / "iter_0000001"], None)
    (tmp_path / "latest").write_text("garbage/../../x\n")
    found, problem = sources.resume_candidates(tmp_path)
    assert found == [tmp_path / f"iter_000000{s}" for s in (3, 2, 1)]
    assert problem == f"{tmp_path}/latest names 'garbage/../../x', which is not a complete checkpoint"
