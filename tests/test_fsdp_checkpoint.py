"""Checkpoints of fully sharded model states (memory.shard_model_states=true, Megatron-FSDP): the per-rank format.

One 4-rank gloo job, dp2 x cp2 UPipe, runs pretrain_llama.main() several times (tiny Llama, shipped corpus,
64-token sequences, float32):
  A         4 steps straight, checkpoints at steps 2 and 4 ("fsdp_per_rank": fsdp/rank0000{0..3}.pt);
  B         resumes A's step-2 checkpoint: steps 3-4 equal A's bit for bit, and B's step-4 checkpoint equals A's
            tensor for tensor (buffers: compute and fp32 main parameters; Adam moments and step counts);
  nanpad    A again with the buffers' padding (the elements that back no parameter; the last rank's shard ends in
            some) filled with NaN right after wrapping: the same losses and weights bit for bit, and the padding
            still NaN at step 4 (nothing reads or writes it); A's and B's padding is zero in every checkpoint
            (it used to hold the allocator's leftovers, NaN bit patterns included, which made torch.equal fail);
  dp4       resumes it as dp4 (cp=1): refused (exit 2) naming parallel.cp and parallel.dp, before any shard is read;
  unsharded resumes it with memory.shard_model_states=false: refused, naming the format;
  olddist   a copy whose train_state.json has no "format" (an older dist_checkpointing checkpoint): refused;
  killed    resumes a copy of A's step 2 as `latest` and dies (an exception from save_checkpoint's before_publish
            hook on rank 0) before publishing step 4: `latest` still names step 2, step 4 is only a .tmp directory.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.dist_helper import run_on_ranks
from tests.train_harness import SMALL, losses, run_main

WORLD = 4
BASE = [*SMALL, "train.steps=4", "parallel.cp=2", "parallel.cp_strategy=upipe", "memory.shard_model_states=true"]
DP4 = ["parallel.cp=1", "parallel.cp_strategy=none"]


class SimulatedKill(Exception):
    pass


def _job(rank, world_size, tmp):
    import torch.distributed as dist

    from megatron_upipe.training import checkpointing

    tmp = Path(tmp)
    out, shard_reads = {}, {}
    orig_load_fsdp, orig_save = checkpointing._load_fsdp, checkpointing.save_checkpoint
    current = [None]

    def counting_load_fsdp(state, ckpt):
        shard_reads[current[0]] = shard_reads.get(current[0], 0) + 1
        return orig_load_fsdp(state, ckpt)

    checkpointing._load_fsdp = counting_load_fsdp

    from megatron_upipe.memory_switches import sharding

    orig_wrap, padding = sharding.wrap_fully_sharded, {}

    def recording_wrap(*args, **kwargs):  # records each run's padding masks; fills nanpad's padding with NaN
        wrapped = orig_wrap(*args, **kwargs)
        masks = sharding.buffer_padding(wrapped)
        padding[current[0]] = masks
        if current[0] == "nanpad":
            for group, group_masks in zip(wrapped.param_and_grad_buffer.parameter_groups, masks):
                for attr, pad in group_masks.items():
                    getattr(group, attr).data.masked_fill_(pad, float("nan"))
        return wrapped

    sharding.wrap_fully_sharded = recording_wrap
    out["padding"] = padding

    def run(name, *overrides):
        current[0] = name
        out[name] = run_main(*BASE, f"log.metrics_file={tmp}/{name}.jsonl", *overrides)

    step2 = f"checkpoint.load={tmp}/A/iter_0000002"
    run("A", f"checkpoint.dir={tmp}/A", "checkpoint.interval=2")
    run("B", f"checkpoint.dir={tmp}/B", "checkpoint.interval=2", step2)
    run("nanpad", f"checkpoint.dir={tmp}/nanpad", "checkpoint.interval=2")
    run("dp4", step2, *DP4)
    run("unsharded", step2, "memory.shard_model_states=false")
    if rank == 0:
        shutil.copytree(tmp / "A" / "iter_0000002", tmp / "olddist" / "iter_0000002")
        meta_file = tmp / "olddist" / "iter_0000002" / "train_state.json"
        meta = json.loads(meta_file.read_text())
        del meta["format"]
        meta_file.write_text(json.dumps(meta))
        shutil.copytree(tmp / "A" / "iter_0000002", tmp / "killed" / "iter_0000002")
        (tmp / "killed" / "latest").write_text("iter_0000002\n")
    dist.barrier()
    run("olddist", f"checkpoint.load={tmp}/olddist/iter_0000002")

    def killing_save(state, root, keep_last=None, before_publish=None):
        if state.step != 4:
            return orig_save(state, root, keep_last, before_publish)

        def die(tmp_dir):  # rank 0, every shard written, nothing published
            raise SimulatedKill(str(tmp_dir))

        try:
            orig_save(state, root, keep_last, die)
        except SimulatedKill:
            dist.barrier()  # the one the other ranks wait in at the end of save_checkpoint
        raise SimulatedKill("killed before publishing step 4")

    checkpointing.save_checkpoint = killing_save
    try:  # last: the run ends with an exception (no teardown)
        run("killed", f"checkpoint.dir={tmp}/killed", "checkpoint.interval=2")
    except SimulatedKill as e:
        out["killed"] = ("SimulatedKill", str(e))
    finally:
        checkpointing.save_checkpoint, checkpointing._load_fsdp = orig_save, orig_load_fsdp
        sharding.wrap_fully_sharded = orig_wrap
    return out, shard_reads


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp_ckpt")
    return tmp, run_on_ranks(_job, WORLD, str(tmp))


def _ok(per_rank, *names):
    for rank, (out, _) in enumerate(per_rank):
        for name in names:
            code, err = out[name]
            assert code == 0, f"rank {rank}, run {name}: exit {code}\n{err}"


def test_the_config_accepts_checkpoints_with_sharded_states():
    from megatron_upipe.config import load_config, validate
    from tests.train_harness import TINY

    validate(load_config(TINY, ["memory.shard_model_states=true", "checkpoint.dir=/tmp/x"]), 4)


def test_checkpoint_is_per_rank(job):
    tmp, per_rank = job
    _ok(per_rank, "A")
    ckpt = tmp / "A" / "iter_0000004"
    meta = json.loads((ckpt / "train_state.json").read_text())
    assert meta["format"] == "fsdp_per_rank"
    assert (meta["layout"]["dp"], meta["layout"]["cp"]) == (2, 2)
    assert sorted(p.name for p in (ckpt / "fsdp").iterdir()) == [f"rank{r:05d}.pt" for r in range(WORLD)]
    assert sorted(p.name for p in (ckpt / "rng").iterdir()) == [f"rank{r:05d}.pt" for r in range(WORLD)]
    assert not (ckpt / ".metadata").exists()  # no dist_checkpointing files
    assert (tmp / "A" / "latest").read_text().strip() == "iter_0000004"


def test_resume_reproduces_the_uninterrupted_run_exactly(job):
    import torch

    tmp, per_rank = job
    _ok(per_rank, "A", "B")
    a, b = losses(tmp / "A.jsonl"), losses(tmp / "B.jsonl")
    assert sorted(a) == [1, 2, 3, 4] and sorted(b) == [3, 4]
    assert a[4] < a[1], a
    assert [b[3], b[4]] == [a[3], a[4]]  # bit-identical
    assert all(reads.get("B") == 1 for _, reads in per_rank)
    for r in range(WORLD):  # the states after step 4: identical, tensor for tensor
        sa, sb = (torch.load(tmp / run / "iter_0000004" / "fsdp" / f"rank{r:05d}.pt", weights_only=False)
                  for run in ("A", "B"))
        assert sa["scheduler"] == sb["scheduler"]
        assert [sorted(g) for g in sa["buffers"]] == [sorted(g) for g in sb["buffers"]]
        for ga, gb in zip(sa["buffers"], sb["buffers"]):
            for key in ga:
                assert torch.equal(ga[key], gb[key]), (r, key)
        for oa, ob in zip(sa["optimizers"], sb["optimizers"]):
            assert oa["param_groups"] == ob["param_groups"]
            assert sorted(oa["state"]) == sorted(ob["state"]) and oa["state"]
            for name, entries in oa["state"].items():
                for key, (kind, value) in entries.items():
                    assert ob["state"][name][key][0] == kind
                    other = ob["state"][name][key][1]
                    assert torch.equal(value, other) if torch.is_tensor(value) else value == other, (r, name, key)


def _buffers(tmp, run, step, rank):
    import torch

    path = tmp / run / f"iter_{step:07d}" / "fsdp" / f"rank{rank:05d}.pt"
    return torch.load(path, weights_only=False)["buffers"]


def test_buffer_padding_is_zero_in_checkpoints_and_never_read(job):
    import torch

    tmp, per_rank = job
    _ok(per_rank, "A", "B", "nanpad")
    pad_counts = []
    for r, (out, _) in enumerate(per_rank):
        masks = out["padding"]["A"]
        assert [sorted(g) for g in masks] == [sorted(g) for g in out["padding"]["nanpad"]]
        assert all(torch.equal(m, out["padding"]["nanpad"][i][k]) for i, g in enumerate(masks) for k, m in g.items())
        pad_counts.append(sum(int(m.sum()) for g in masks for m in g.values()))
        for run, step in (("A", 2), ("A", 4), ("B", 4)):
            for group, bufs in zip(masks, _buffers(tmp, run, step, r)):
                assert sorted(group) == sorted(bufs)
                for key, pad in group.items():
                    assert bool((bufs[key][pad] == 0).all()), (run, step, r, key)
        for group, a, n in zip(masks, _buffers(tmp, "A", 4, r), _buffers(tmp, "nanpad", 4, r)):
            for key, pad in group.items():
                assert bool(torch.isnan(n[key][pad]).all()), (r, key)  # never written
                assert torch.equal(n[key][~pad], a[key][~pad]), (r, key)  # and never read
    assert pad_counts[-1] > 0, pad_counts  # this layout has padding (on the last rank at least)
    assert losses(tmp / "nanpad.jsonl") == losses(tmp / "A.jsonl")  # bit-identical


def test_another_layout_is_refused_before_reading_shards(job):
    tmp, per_rank = job
    for out, reads in per_rank:
        code, err = out["dp4"]
        assert code == 2, err
        assert "parallel.cp: checkpoint 2 != run 1" in err and "parallel.dp: checkpoint 2 != run 4" in err, err
        assert "Resume with the same tp/pp/cp/dp (parallel.tp=1 parallel.pp=1 parallel.cp=2 parallel.dp=2" in err
        assert "dp4" not in reads
    assert not (tmp / "dp4.jsonl").exists()


def test_the_other_format_is_refused(job):
    tmp, per_rank = job
    for out, reads in per_rank:
        code, err = out["unsharded"]
        assert code == 2 and "'fsdp_per_rank'" in err and "resume with memory.shard_model_states=true" in err, err
        code, err = out["olddist"]
        assert code == 2 and "'dist_checkpointing' format" in err, err
        assert "resume with memory.shard_model_states=false" in err, err
        assert "unsharded" not in reads and "olddist" not in reads
    assert not (tmp / "unsharded.jsonl").exists() and not (tmp / "olddist.jsonl").exists()


def test_a_save_killed_before_publishing_leaves_latest_on_the_previous_checkpoint(job):
    tmp, per_rank = job
    for out, _ in per_rank:
        assert out["killed"] == ("SimulatedKill", "killed before publishing step 4"), out["killed"]
    ckpt = tmp / "killed"
    assert (ckpt / "latest").read_text().strip() == "iter_0000002"
    assert (ckpt / "iter_0000004.tmp" / "train_state.json").is_file()  # every shard was written...
    assert len(list((ckpt / "iter_0000004.tmp" / "fsdp").iterdir())) == WORLD
    assert not (ckpt / "iter_0000004").exists()  # ...but never published
    from megatron_upipe.training.checkpointing import find_checkpoint

    assert find_checkpoint(ckpt) == ckpt / "iter_0000002"
    a, k = losses(tmp / "A.jsonl"), losses(tmp / "killed.jsonl")
    assert [k[3], k[4]] == [a[3], a[4]]  # resumed from `latest` (the copy of A's step 2)
