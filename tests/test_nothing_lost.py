"""Nothing lost, nothing silent: a run never overwrites, deletes or shares another run's checkpoints unless told to.

Each case records the md5 of every file of the checkpoints that were there before and checks them afterwards.

One 1-rank gloo job (pretrain_llama.main() in a spawned process, tiny Llama, cp=1, float32 on CPU) runs, in order:
  first       2 steps, a checkpoint at each step;
  fresh       checkpoint.resume=false into that directory: refused at start-up (exit 2, one line), files unchanged;
  held        the directory's LOCK names a live process on this host: refused (exit 2, one line naming it);
  stale       the LOCK names a dead process: taken; the run resumes step 2 -> 3 and removes the LOCK at its end;
              the metrics file held a record of step 3 left by a killed run: the file keeps one step 3;
  ctrl_c      SIGINT during step 4 (as Ctrl-C): the step is saved, main() returns 5 (and writes it to
              --status-file), "stopped by SIGINT";
  deadline    steps of 1000 s by a fake clock and train.exit_duration_mins=60: saved and stopped (exit 5) after
              the step after which another step, a save and the margin would pass the deadline;
  evil        the latest checkpoint's RNG file carries a pickled callable: refused in one line, never run;
  overwrite   checkpoint.resume=false checkpoint.overwrite=true: the old checkpoints stay until the new run's first
              checkpoint is published, then are removed.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import signal
import socket
import subprocess
from pathlib import Path

import pytest

from tests.dist_helper import run_on_ranks
from tests.train_harness import SMALL, pretrain_error_line, read_metrics, run_main

ONE_RANK = [*SMALL, "parallel.cp=1", "data.split=[0.3, 99.6, 0.1]", "checkpoint.keep_last=null"]


def md5s(root: Path) -> dict[str, str]:
    """md5 of every file under root's iter_* directories and of `latest`."""
    files = [p for p in sorted(root.rglob("*")) if p.is_file() and (p.name == "latest" or "iter_" in str(p))]
    return {str(p.relative_to(root)): hashlib.md5(p.read_bytes()).hexdigest() for p in files}


def _run(tmp: Path, *overrides: str) -> tuple[int, str, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code, err = run_main(*ONE_RANK, f"checkpoint.dir={tmp}/ckpt", f"log.metrics_file={tmp}/metrics.jsonl",
                             *overrides)
    return code, err, out.getvalue()


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def _job(rank, world_size, tmp):
    from megatron_upipe.training import checkpoint_guard, loop

    tmp = Path(tmp)
    ckpt = tmp / "ckpt"
    out = {}
    out["first"] = _run(tmp, "train.steps=2", "checkpoint.interval=1")
    out["first_md5"] = md5s(ckpt)
    out["first_listing"] = sorted(p.name for p in ckpt.iterdir())

    out["fresh"] = _run(tmp, "train.steps=2", "checkpoint.resume=false")
    out["fresh_md5"] = md5s(ckpt)

    me = checkpoint_guard.Holder.this_process()
    live = dict(me.__dict__, pid=os.getppid(), pid_start=checkpoint_guard._pid_start(os.getppid()))
    (ckpt / "LOCK").write_text(json.dumps(live))
    out["held"] = _run(tmp, "train.steps=3")
    out["held_md5"] = md5s(ckpt)

    (ckpt / "LOCK").write_text(json.dumps(dict(me.__dict__, pid=_dead_pid(), pid_start="1")))
    with open(tmp / "metrics.jsonl", "a") as f:  # a killed run logged step 3 and saved nothing after step 2
        f.write(json.dumps({"kind": "train", "step": 3, "loss": 99.0}) + "\n")
    out["stale"] = _run(tmp, "train.steps=3", "checkpoint.interval=1")
    out["stale_lock_left"] = (ckpt / "LOCK").exists()
    out["stale_steps"] = [r["step"] for r in read_metrics(tmp / "metrics.jsonl")]
    out["stale_md5"] = md5s(ckpt)
    out["stale_listing"] = sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*"))

    orig = loop.train_step

    def ctrl_c_in_step_4(state, data_iterator, *args):
        result = orig(state, data_iterator, *args)
        if state.step + 1 == 4:
            os.kill(os.getpid(), signal.SIGINT)
        return result

    loop.train_step = ctrl_c_in_step_4
    try:
        out["ctrl_c"] = _run(tmp, "train.steps=6", "--status-file", str(tmp / "status"))
    finally:
        loop.train_step = orig
    out["ctrl_c_latest"] = (ckpt / "latest").read_text().strip()

    import torch

    out["deadline"] = _deadline_run(tmp)

    from megatron_upipe.checkpoint.sources import MANIFEST, crc32_file

    rng_file = ckpt / "iter_0000004" / "rng" / "rank00000.pt"
    manifest = ckpt / "iter_0000004" / MANIFEST
    saved_rng, saved_manifest = rng_file.read_bytes(), manifest.read_bytes()
    torch.save({"torch": torch.zeros(3), "evil": _RunsCode(tmp / "ran")}, rng_file)
    entries = json.loads(saved_manifest)  # someone else's checkpoint: its manifest agrees with its files
    size, crc = crc32_file(rng_file)
    entries["files"]["rng/rank00000.pt"] = {"bytes": size, "crc32": crc}
    manifest.write_text(json.dumps(entries))
    out["evil"] = _run(tmp, "train.steps=6")
    out["evil_ran"] = (tmp / "ran").exists()
    rng_file.write_bytes(saved_rng)
    manifest.write_bytes(saved_manifest)
    before = md5s(ckpt)

    seen = []
    real_save = loop.checkpointing.save_checkpoint

    def save(state, root, **kw):
        path = real_save(state, root, **kw)
        seen.append(sorted(p.name for p in Path(root).iterdir() if p.name != "LOCK"))  # published, not yet removed
        return path

    loop.checkpointing.save_checkpoint = save
    try:
        out["overwrite"] = _run(tmp, "train.steps=2", "checkpoint.interval=1", "checkpoint.resume=false",
                                "checkpoint.overwrite=true")
    finally:
        loop.checkpointing.save_checkpoint = real_save
    out["overwrite_before"] = before
    out["overwrite_seen"] = seen
    out["overwrite_listing"] = sorted(p.name for p in ckpt.iterdir())
    meta = ckpt / "iter_0000001" / "train_state.json"
    out["overwrite_meta"] = json.loads(meta.read_text())["config"] if meta.is_file() else None
    return out


def _deadline_run(tmp: Path):
    """A run whose steps take 1000 s by a fake clock (the loop's and the deadline's), train.exit_duration_mins=60."""
    import types

    from megatron_upipe.training import deadline, loop

    clock = [1.0e9]
    orig_step, orig_time, orig_now = loop.train_step, loop.time, deadline.now

    def slow_step(state, data_iterator, *args):
        clock[0] += 1000.0
        return orig_step(state, data_iterator, *args)

    loop.train_step, deadline.now = slow_step, lambda: clock[0]
    loop.time = types.SimpleNamespace(perf_counter=lambda: clock[0])
    try:
        return _run(tmp, "train.steps=9", "train.exit_duration_mins=60", "checkpoint.dir=" + str(tmp / "dl"),
                    f"log.metrics_file={tmp}/dl.jsonl")
    finally:
        loop.train_step, loop.time, deadline.now = orig_step, orig_time, orig_now


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("nothing_lost")
    return tmp, run_on_ranks(_job, 1, str(tmp))[0]


_one_line = pretrain_error_line


def test_first_run_saves_each_step(job):
    _, out = job
    assert out["first"][0] == 0, out["first"][1]
    assert out["first_listing"] == ["iter_0000001", "iter_0000002", "latest"]  # no LOCK left behind


def test_a_fresh_run_into_a_directory_with_checkpoints_is_refused(job):
    tmp, out = job
    code, err, _ = out["fresh"]
    assert code == 2
    line = _one_line(err)
    assert (f"checkpoint.resume=false but checkpoint.dir={tmp}/ckpt holds checkpoints (iter_0000001, iter_0000002)"
            in line and "checkpoint.overwrite=true" in line), line
    assert out["fresh_md5"] == out["first_md5"]


def test_a_directory_held_by_a_live_run_is_refused_naming_it(job):
    tmp, out = job
    code, err, _ = out["held"]
    assert code == 2
    line = _one_line(err)
    assert f"checkpoint.dir={tmp}/ckpt is in use by another run (host {socket.gethostname()}, pid " in line, line
    assert f"remove {tmp}/ckpt/LOCK" in line
    assert out["held_md5"] == out["first_md5"]


def test_a_stale_lock_does_not_block_the_resume_and_metrics_keep_one_curve(job):
    _, out = job
    code, err, stdout = out["stale"]
    assert code == 0, err
    assert "resumed from" in stdout and "at step 2" in stdout
    assert not out["stale_lock_left"]
    assert out["stale_steps"] == [1, 2, 3]  # the killed run's step 3 replaced by the resumed run's
    assert all(out["stale_md5"].get(k) == v for k, v in out["first_md5"].items() if k != "latest"), \
        out["stale_listing"]


def test_ctrl_c_saves_the_step_and_exits_5(job):
    tmp, out = job
    code, err, _ = out["ctrl_c"]
    assert code == 5, err
    assert f"stopped by SIGINT after step 4 of 6: checkpoint {tmp}/ckpt/iter_0000004 saved; exit code 5" in err
    assert out["ctrl_c_latest"] == "iter_0000004"
    assert (tmp / "status").read_text() == "5\n"  # what the launchers exit with (torchrun's own code is 1)


def test_a_checkpoint_carrying_code_is_refused_not_run(job):
    tmp, out = job
    code, err, _ = out["evil"]
    assert code == 2 and not out["evil_ran"]
    line = _one_line(err)
    assert f"{tmp}/ckpt/iter_0000004/rng/rank00000.pt holds more than tensors and plain values" in line, line


def test_a_run_saves_and_stops_before_its_deadline(job):
    tmp, out = job
    code, err, stdout = out["deadline"]
    assert code == 5, err
    # after step 2 (2000 s): 2000 + 1000 + 300 + 120 = 3420 <= 3600, go on; after step 3: 4420 > 3600, stop
    assert (f"stopped before the job's deadline after step 3 of 9: checkpoint {tmp}/dl/iter_0000003 saved; exit code "
            f"5") in err, err
    assert "deadline in 1.00 h" in stdout
    assert (tmp / "dl" / "latest").read_text().strip() == "iter_0000003"


def test_overwrite_true_replaces_the_old_checkpoints_only_after_its_first_save(job):
    _, out = job
    code, err, _ = out["overwrite"]
    assert code == 0, err
    old = sorted({k.split("/")[0] for k in out["overwrite_before"] if k != "latest"})
    assert old == ["iter_0000001", "iter_0000002", "iter_0000003", "iter_0000004"]
    # all still there when the new step 1 was published (its iter_0000001 in place of the old one), gone after it
    assert out["overwrite_seen"] == [[*old, "latest"], ["iter_0000001", "iter_0000002", "latest"]]
    assert out["overwrite_listing"] == ["iter_0000001", "iter_0000002", "latest"]
    assert out["overwrite_meta"]["checkpoint"]["overwrite"] is True  # the new run's step 1, not the old one


def test_second_ctrl_c_stops_at_once_and_duplicates_are_one(monkeypatch):
    from megatron_upipe.training import signals

    clock = [100.0]
    monkeypatch.setattr(signals.time, "monotonic", lambda: clock[0])
    stop = signals.StopOnSignal()
    stop._record(signal.SIGINT, None)
    clock[0] += signals.SAME_CTRL_C_S / 2  # the same Ctrl-C, forwarded by torchrun
    stop._record(signal.SIGINT, None)
    assert stop.received == signal.SIGINT
    clock[0] += signals.SAME_CTRL_C_S * 2
    with pytest.raises(KeyboardInterrupt):
        stop._record(signal.SIGINT, None)


def test_ctrl_c_outside_the_loop_is_one_line_and_exit_130(monkeypatch, capsys):
    import pretrain_llama

    def interrupted(*a):
        raise KeyboardInterrupt

    monkeypatch.setattr(pretrain_llama, "run_job", interrupted)
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k not in pretrain_llama.TORCHRUN_VARS})
    code, err = run_main(*ONE_RANK)
    assert code == pretrain_llama.EXIT_INTERRUPTED == 130
    assert _one_line(err) == "pretrain_llama.py: rank 0: interrupted (Ctrl-C): stopped without saving"


def test_dry_run_refuses_a_fresh_run_over_checkpoints(tmp_path, capsys):
    import pretrain_llama

    ckpt = tmp_path / "ckpt" / "iter_0000007"
    ckpt.mkdir(parents=True)
    (ckpt / "train_state.json").write_text("{}")
    (ckpt / "__0_0.distcp").write_bytes(os.urandom(64))
    (tmp_path / "ckpt" / "latest").write_text("iter_0000007\n")
    before = md5s(tmp_path / "ckpt")
    argv = ["--config", str(Path(pretrain_llama.__file__).parent / "examples/configs/tiny_cpu.yaml"), "--dry-run",
            "--world-size", "2", f"checkpoint.dir={tmp_path}/ckpt", "checkpoint.resume=false"]
    assert pretrain_llama.main(argv) == 2
    assert "holds checkpoints (iter_0000007)" in _one_line(capsys.readouterr().err)
    assert pretrain_llama.main([*argv, "checkpoint.overwrite=true"]) == 0
    assert md5s(tmp_path / "ckpt") == before


class _RunsCode:
    """A pickled callable: loading it with weights_only=False would run `touch MARKER`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_our_files_load_only_tensors_and_plain_values(tmp_path):
    import torch

    from megatron_upipe.checkpoint.sources import CheckpointError
    from megatron_upipe.training.checkpointing import load_own_file

    marker = tmp_path / "ran"
    bad = tmp_path / "rank00000.pt"
    torch.save({"torch": torch.zeros(3), "evil": _RunsCode(marker)}, bad)
    with pytest.raises(CheckpointError) as e:
        load_own_file(bad)
    assert not marker.exists()
    assert "\n" not in str(e.value) and f"{bad} holds more than tensors and plain values" in str(e.value)
    assert "refusing to load it" in str(e.value)
    good = tmp_path / "good.pt"
    torch.save({"t": torch.arange(3), "python": (3, (1, 2), None), "numpy": ("MT19937", torch.zeros(2), 1, 0, 0.0)},
               good)
    assert load_own_file(good)["python"] == (3, (1, 2), None)
    import numpy as np

    from megatron_upipe.training.checkpointing import _numpy_state_from_saved, _numpy_state_as_tensor

    old = tmp_path / "old_rng.pt"  # an RNG file of an earlier version: numpy's state array itself
    torch.save({"numpy": np.random.get_state()}, old)
    state = _numpy_state_from_saved(load_own_file(old)["numpy"])
    assert np.array_equal(state[1], np.random.get_state()[1])
    now = _numpy_state_from_saved(_numpy_state_as_tensor(np.random.get_state()))
    assert now[1].dtype == np.uint32 and np.array_equal(now[1], np.random.get_state()[1])


HELPER_DRIVER = """
import sys
sys.path.insert(0, {root!r})
from megatron_upipe.training.helpers import die_with_parent
{hook}
if __name__ == "__main__":
    import multiprocessing, time
    from megatron_upipe.training.signals import blocked_in_children
    with blocked_in_children():  # as the job's saves start megatron-core's writer Manager: deaf to SIGTERM
        manager = multiprocessing.get_context("spawn").Manager()
    print(manager._process.pid, flush=True)
    time.sleep(120)
"""


def _child_of(cmdline: Path, parent: int) -> bool:
    with contextlib.suppress(OSError, IndexError, ValueError):
        return int((cmdline.parent / "stat").read_text().rsplit(")", 1)[1].split()[1]) == parent
    return False


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie is dead (reparented to a PID 1 that may not reap it)


@pytest.mark.parametrize("hook", [True, False], ids=["die_with_parent", "without"])
def test_a_killed_ranks_writer_helper_does_not_outlive_it(hook, tmp_path):
    """A process that spawned a multiprocessing Manager (megatron-core's checkpoint writer does, on the first save)
    is SIGKILLed: with the entry script's die_with_parent(__name__) the Manager dies with it; without, it survives
    (the leak this prevents). pretrain_llama.py makes that call at its top level."""
    import ast
    import sys
    import time

    from tests.train_harness import ROOT

    driver = tmp_path / "driver.py"
    driver.write_text(HELPER_DRIVER.format(root=str(ROOT), hook="die_with_parent(__name__)" if hook else ""))
    proc = subprocess.Popen([sys.executable, str(driver)], stdout=subprocess.PIPE, text=True)
    helper = int(proc.stdout.readline())
    tracker = [int(p.parent.name) for p in Path("/proc").glob("[0-9]*/cmdline") if _child_of(p, proc.pid) and
               b"resource_tracker" in p.read_bytes()]
    try:
        assert _alive(helper) and len(tracker) == 1
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 10
        while (_alive(helper) or _alive(tracker[0])) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _alive(helper) is not hook
        assert not hook or not _alive(tracker[0])  # multiprocessing's tracker ends once its pipe's holders are gone
    finally:
        for pid in (helper, *tracker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    tree = ast.parse((ROOT / "pretrain_llama.py").read_text())
    calls = [n.value for n in tree.body if isinstance(n, ast.Expr) and isinstance(n.value, ast.Call)]
    assert any(getattr(c.func, "id", None) == "die_with_parent" and [getattr(a, "id", None) for a in c.args] ==
               ["__name__"] for c in calls)
