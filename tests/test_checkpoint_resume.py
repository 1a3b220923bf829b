"""Checkpoints of the training job: exact resume, resume into other layouts, refused mismatches, the NaN policy,
and atomicity under a kill.

One 2-rank gloo job runs pretrain_llama.main() several times (tiny Llama, shipped corpus, 64-token sequences):
  A      6 steps straight, cp=2 UPipe, checkpoints at steps 3 and 6;
  B      resumes A's step-3 checkpoint in the same layout: steps 4-6 must equal A's bit for bit (CPU, float32);
  tp2    resumes it as tp=2 (no CP), cp1dp2 as cp=1 x dp=2: megatron-core reshards; losses equal A's (rtol 1e-5)
         (cp=2 -> cp=4 needs 4 ranks: tests/test_train_equivalence.py);
  shape  4 layers instead of 2, tokenizer: a copy whose recorded tokenizer differs: both refused (exit 2), naming
         the field, before any tensor is read;
  stop / skip  a NaN injected into step 3's forward: stop ends the run (exit 3, "step 3") with the weights of
         step 2 and the step-2 checkpoint as `latest`; skip leaves weights and Adam moments unchanged and goes on.
Last, a fresh run (checkpoint.resume=false) into A's directory re-saves steps 3 and 6 over A's checkpoints.
mockA / mockB  the same exact resume on mock data (global batch 2, 3 steps, checkpoint at 1): the resumed run
         serves sample 2 first, whose labels hold the pad id (a mock document counts 1, 2, 3 = pad, ...), which
         megatron-core 0.19.2's dataset used to write into the loss-mask cache of every later sample
         (megatron_upipe/data/gpt_dataset.py).
The kill test runs torchrun in a subprocess and SIGKILLs rank 0 in the middle of the step-4 save (all shards
written, not yet published): `latest` still names step 2, which a second launch resumes, reproducing steps 3-4.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.dist_helper import free_port, run_on_ranks
from tests.train_harness import DATA, ROOT, SMALL, TINY, losses, processes_with, read_metrics, run_main

BASE = [*SMALL, "train.steps=6"]
CP1_DP2 = ["parallel.cp=1", "parallel.cp_strategy=none"]
MOCK = [*SMALL, "data.path=mock", "train.global_batch_size=2", "train.steps=3"]
TP2 = ["parallel.tp=2", *CP1_DP2]


def _tensors(obj) -> list:
    import torch

    if isinstance(obj, torch.Tensor):
        return [obj.detach().clone()]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def _inject_nan_at(step_no: int, unchanged: dict):
    """Patch the loop so that step `step_no`'s forward returns NaN; record whether weights/Adam state changed."""
    import torch

    from megatron_upipe.training import loop

    orig_step, orig_forward = loop.train_step, loop._forward_step

    def poisoned_forward(data_iterator, model):
        out, loss_func = orig_forward(data_iterator, model)
        return out * float("nan"), loss_func

    def train_step(state, data_iterator, *args):
        if state.step + 1 != step_no:
            return orig_step(state, data_iterator, *args)
        before = _tensors(list(state.model.parameters())) + _tensors(state.optimizer.state_dict()["state"])
        loop._forward_step = poisoned_forward
        try:
            return orig_step(state, data_iterator, *args)
        finally:
            loop._forward_step = orig_forward
            after = _tensors(list(state.model.parameters())) + _tensors(state.optimizer.state_dict()["state"])
            unchanged[state.config.train.nan_policy] = len(before) == len(after) > 0 and all(
                torch.equal(a, b) for a, b in zip(before, after))

    loop.train_step = train_step
    return lambda: setattr(loop, "train_step", orig_step)


def _job(rank, world_size, tmp):
    import torch.distributed as dist

    tmp = Path(tmp)
    out = {}

    def run(name, *overrides):
        out[name] = run_main(*BASE, f"checkpoint.dir={tmp}/{name}", f"log.metrics_file={tmp}/{name}.jsonl",
                             *overrides)

    run("A", "checkpoint.interval=3")
    step3 = f"checkpoint.load={tmp}/A/iter_0000003"
    run("B", step3)
    run("tp2", step3, *TP2)
    run("cp1dp2", step3, *CP1_DP2)
    run("shape", step3, "model.num_layers=4")
    if rank == 0:
        shutil.copytree(tmp / "A" / "iter_0000003", tmp / "other_tok" / "iter_0000003")
        meta_file = tmp / "other_tok" / "iter_0000003" / "train_state.json"
        meta = json.loads(meta_file.read_text())
        meta["tokenizer"]["sha256"] = "0" * 64
        meta_file.write_text(json.dumps(meta))
    dist.barrier()
    run("tokenizer", f"checkpoint.load={tmp}/other_tok/iter_0000003")
    unchanged = {}
    undo = _inject_nan_at(3, unchanged)
    try:
        run("stop", "train.steps=4", "checkpoint.interval=2")
        run("skip", "train.steps=4", "train.nan_policy=skip")
    finally:
        undo()
    # A fresh run (resume=false) into A's directory, told to overwrite it, saves steps 3 and 6 again over A's
    # (without checkpoint.overwrite=true it is refused: tests/test_nothing_lost.py).
    out["again"] = run_main(*BASE, f"checkpoint.dir={tmp}/A", "checkpoint.resume=false", "checkpoint.overwrite=true",
                            "checkpoint.interval=3", f"log.metrics_file={tmp}/again.jsonl")
    out["mockA"] = run_main(*MOCK, f"checkpoint.dir={tmp}/mockA", "checkpoint.interval=1", "checkpoint.keep_last=null",
                            f"log.metrics_file={tmp}/mockA.jsonl")
    out["mockB"] = run_main(*MOCK, f"checkpoint.dir={tmp}/mockB", f"checkpoint.load={tmp}/mockA/iter_0000001",
                            f"log.metrics_file={tmp}/mockB.jsonl")
    return out, unchanged


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resume")
    per_rank = run_on_ranks(_job, 2, str(tmp))
    return tmp, per_rank


def _ok(per_rank, *names):
    for rank, (out, _) in enumerate(per_rank):
        for name in names:
            code, err = out[name]
            assert code == 0, f"rank {rank}, run {name}: exit {code}\n{err}"


def test_resume_reproduces_the_uninterrupted_curve_exactly(job):
    tmp, per_rank = job
    _ok(per_rank, "A", "B")
    a, b = losses(tmp / "A.jsonl"), losses(tmp / "B.jsonl")
    assert sorted(a) == [1, 2, 3, 4, 5, 6] and sorted(b) == [4, 5, 6]
    assert [b[s] for s in (4, 5, 6)] == [a[s] for s in (4, 5, 6)]  # bit-identical
    lr_a = {r["step"]: r["lr"] for r in read_metrics(tmp / "A.jsonl")}
    assert all(r["lr"] == lr_a[r["step"]] for r in read_metrics(tmp / "B.jsonl"))
    assert (tmp / "B" / "latest").read_text().strip() == "iter_0000006"
    meta = json.loads((tmp / "B" / "iter_0000006" / "train_state.json").read_text())
    assert (meta["step"], meta["consumed_samples"]) == (6, 24)


def test_resume_on_mock_data_reproduces_the_uninterrupted_curve_exactly(job):
    tmp, per_rank = job
    _ok(per_rank, "mockA", "mockB")
    a, b = losses(tmp / "mockA.jsonl"), losses(tmp / "mockB.jsonl")
    assert sorted(a) == [1, 2, 3] and sorted(b) == [2, 3]
    assert [b[2], b[3]] == [a[2], a[3]]  # bit-identical (was 2e-4 apart)


@pytest.mark.parametrize("name", ["tp2", "cp1dp2"])
def test_resume_into_another_layout(job, name):
    tmp, per_rank = job
    _ok(per_rank, "A", name)
    a, other = losses(tmp / "A.jsonl"), losses(tmp / f"{name}.jsonl")
    assert sorted(other) == [4, 5, 6]
    assert [other[s] for s in (4, 5, 6)] == pytest.approx([a[s] for s in (4, 5, 6)], rel=1e-5)
    layout = json.loads((tmp / name / "iter_0000006" / "train_state.json").read_text())["layout"]
    assert (layout["tp"], layout["cp"], layout["dp"]) == ((2, 1, 1) if name == "tp2" else (1, 1, 2))


def test_mismatched_model_or_tokenizer_is_refused(job):
    tmp, per_rank = job
    for out, _ in per_rank:
        code, err = out["shape"]
        assert code == 2 and "does not match" in err and "model.num_layers: checkpoint 2 != config 4" in err, err
        code, err = out["tokenizer"]
        assert code == 2 and "tokenizer sha256: checkpoint '0000" in err, err
        assert "model." not in err.split("refusing to load it")[1]  # only the tokenizer differs
    assert not (tmp / "shape.jsonl").exists() and not (tmp / "shape").exists()  # nothing trained or saved


def test_nan_stop_names_the_step_and_keeps_the_weights(job):
    tmp, per_rank = job
    for out, unchanged in per_rank:
        code, err = out["stop"]
        assert code == 3 and "step 3: non-finite loss" in err and "weights unchanged" in err, err
        assert unchanged["stop"] is True
    assert sorted(losses(tmp / "stop.jsonl")) == [1, 2]
    assert (tmp / "stop" / "latest").read_text().strip() == "iter_0000002"


def test_nan_skip_leaves_weights_unchanged_and_continues(job):
    tmp, per_rank = job
    _ok(per_rank, "skip")
    records = {r["step"]: r for r in read_metrics(tmp / "skip.jsonl")}
    assert sorted(records) == [1, 2, 3, 4]
    assert records[3]["skipped"] is True and records[3]["loss"] is None  # NaN is written as null
    assert records[4]["skipped"] is False and records[4]["loss"] < records[1]["loss"]
    assert all(unchanged["skip"] is True for _, unchanged in per_rank)


# pretrain_llama.py with the step-`KILL_AT_SAVE_STEP` save killing its own process (rank 0) just before publishing.
# The __main__ guard matters: dist_checkpointing's writer starts processes that re-import the main module.
KILL_DRIVER = """
import os, signal, sys


def killed_save_factory(save, kill_at):
    def killed_save(state, root, keep_last=None, before_publish=None):
        def die(tmp_dir):  # every shard is on disk, nothing is published yet
            os.kill(os.getpid(), signal.SIGKILL)
        return save(state, root, keep_last, die if state.step == kill_at else None)
    return killed_save


if __name__ == "__main__":
    sys.path.insert(0, {root!r})
    from megatron_upipe.training import checkpointing
    import pretrain_llama

    kill_at = int(os.environ.get("KILL_AT_SAVE_STEP", "0"))
    checkpointing.save_checkpoint = killed_save_factory(checkpointing.save_checkpoint, kill_at)
    sys.exit(pretrain_llama.main(sys.argv[1:]))
"""


def _launch(driver: Path, tmp: Path, env_extra: dict, log_name: str) -> tuple[int, str]:
    """torchrun with 2 ranks; returns (exit code, output). megatron-core's checkpoint writer starts a
    multiprocessing Manager in each writing rank, which outlives a SIGKILLed rank: such leftovers (found by a
    token in their environment) are killed afterwards."""
    token = f"UPIPE_KILL_TEST_{uuid.uuid4().hex}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           str(driver), "--config", TINY, *DATA, *BASE, f"checkpoint.dir={tmp}/ckpt", "checkpoint.interval=2",
           f"log.metrics_file={tmp}/metrics.jsonl", "dist.timeout_s=60"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", token: "1", **env_extra}
    log = tmp / log_name
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            code = proc.wait(timeout=300)
        finally:
            proc.kill()
            for pid in processes_with(token):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    return code, log.read_text()


def test_save_killed_midway_leaves_the_previous_checkpoint_loadable(tmp_path):
    driver = tmp_path / "driver.py"
    driver.write_text(KILL_DRIVER.format(root=str(ROOT)))
    ckpt = tmp_path / "ckpt"
    code, output = _launch(driver, tmp_path, {"KILL_AT_SAVE_STEP": "4"}, "killed.log")
    assert code != 0 and "Signal 9 (SIGKILL)" in output, output[-3000:]
    assert (ckpt / "latest").read_text().strip() == "iter_0000002"
    assert (ckpt / "iter_0000004.tmp" / "train_state.json").is_file()  # the save got that far...
    assert not (ckpt / "iter_0000004").exists()  # ...but was never published
    first = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in first] == [1, 2, 3, 4]

    code, output = _launch(driver, tmp_path, {}, "resumed.log")
    assert code == 0, output[-3000:]
    assert f"resumed from {ckpt / 'iter_0000002'} at step 2" in output
    # One curve: the killed run's steps 3-4 are replaced by the resumed run's, which reproduce them exactly.
    both = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in both] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in both[2:4]] == [r["loss"] for r in first[2:]]
    assert (ckpt / "latest").read_text().strip() == "iter_0000006"
    assert sorted(p.name for p in ckpt.iterdir()) == ["iter_0000004", "iter_0000006", "latest"]  # keep_last=2


def test_a_fresh_run_saves_over_old_checkpoints_of_the_same_steps(job):
    tmp, per_rank = job
    _ok(per_rank, "again")
    assert losses(tmp / "again.jsonl") == losses(tmp / "A.jsonl")  # started fresh, same data and seed
    ckpt = tmp / "A"
    assert sorted(p.name for p in ckpt.iterdir()) == ["iter_0000003", "iter_0000006", "latest"]
    assert (ckpt / "latest").read_text().strip() == "iter_0000006"


def test_latest_survives_a_kill_while_resaving_its_own_step(tmp_path):
    """Re-saving the step `latest` names moves the old copy aside first: between the two renames `latest` still
    finds a complete checkpoint (the moved copy); a missing or incomplete target is an error, never a silent start."""
    from megatron_upipe.training.checkpointing import CheckpointError, find_checkpoint

    (tmp_path / "latest").write_text("iter_0000004\n")
    (tmp_path / "iter_0000004.replaced").mkdir()
    (tmp_path / "iter_0000004.replaced" / "train_state.json").write_text("{}")
    assert find_checkpoint(tmp_path) == tmp_path / "iter_0000004.replaced"
    (tmp_path / "iter_0000004").mkdir()
    (tmp_path / "iter_0000004" / "train_state.json").write_text("{}")
    assert find_checkpoint(tmp_path) == tmp_path / "iter_0000004"
    assert find_checkpoint(tmp_path / "iter_0000004") == tmp_path / "iter_0000004"
    assert find_checkpoint(tmp_path / "nothing_here") is None
    (tmp_path / "latest").write_text("iter_0000008\n")
    with pytest.raises(CheckpointError, match="names iter_0000008, which is not a complete checkpoint"):
        find_checkpoint(tmp_path)
