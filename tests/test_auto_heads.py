"""parallel.upipe_heads_per_stage=auto (and unset, in the training job): at start-up the memory planner picks the
fastest legal U whose plan fits memory.plan_gpu (and the host), every rank the same (with serial stages the largest
that fits); it says which and why (also in --dry-run), and refuses in one line when no U fits or when an explicit
auto has no device size to plan against (unset: the smallest legal U, said so).

The shape: the `small` preset (8 query / 4 KV heads, d 32) on cp 2 at 256K tokens with full recompute and tiled
MLP/loss, so attention decides the peak; its plans grow with U (U=2 < U=4 < U=8), and 4.6 GiB lies between U=4's
and U=8's.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist_helper import run_on_ranks

ROOT = Path(__file__).resolve().parents[1]
SHAPE = ["parallel.upipe_heads_per_stage=auto", "train.seq_length=262144", "train.micro_batch_size=1",
         "train.global_batch_size=1", "model.preset=small", "memory.mlp_chunks=8", "memory.loss_chunks=8",
         "memory.recompute=full"]


def _dry_run(*overrides):
    return subprocess.run(
        [sys.executable, "pretrain_llama.py", "--config", "examples/configs/tiny_cpu.yaml", "--dry-run",
         "--world-size", "2", *SHAPE, *overrides], cwd=ROOT, capture_output=True, text=True, timeout=600)


def _plans(gpu_gib: float) -> dict[int, tuple[int, bool]]:
    """Every legal U's plan, one estimate each (the brute force the choice must agree with), in a spawned process:
    the planner installs the CPU patches, which must not leak into the test process."""
    return run_on_ranks(_plans_job, 1, gpu_gib)[0]


def _plans_job(rank, world_size, gpu_gib):
    import torch.distributed as dist

    from megatron_upipe.planner.devices import margins_for, resolve_gpu
    from megatron_upipe.planner.estimate import ConfigSource, estimate

    dist.destroy_process_group()  # the planner makes its own fake one

    gpu = resolve_gpu(str(gpu_gib))
    source = ConfigSource(str(ROOT / "examples/configs/tiny_cpu.yaml"),
                          (*SHAPE, f"data.tokenizer={ROOT / 'data/tokenizer/spm.model'}"))
    return {U: (e.peak_bytes, e.fits) for U in (2, 4, 8)
            for e in [estimate(source, 2, 4096, f"upipe:{U}", 262144, gpu.total_bytes, margins_for(gpu, 2))]}


def test_dry_run_picks_the_largest_u_that_fits():
    proc = _dry_run("memory.plan_gpu=4.85")
    assert proc.returncode == 0, proc.stderr[-2000:]
    plans = _plans(4.85)
    best = max(U for U, (_, fits) in plans.items() if fits)
    assert best == 4 and not plans[8][1], plans  # the shape is chosen so that the choice is not trivial
    assert f"parallel.upipe_heads_per_stage=auto -> U={best} (2 stages): the largest legal U whose plan fits" \
        in proc.stdout
    assert f"upipe: {best} heads per stage (over the cp ranks), 2 stages" in proc.stdout
    assert f"U=8: {plans[8][0] / 2**30:.2f} GiB" in proc.stdout


@pytest.mark.parametrize("overrides, message", [
    (["memory.plan_gpu=4.0"], "parallel.upipe_heads_per_stage=auto: no legal U (2, 4, 8) fits 4GiB at "
                              "train.seq_length=262144: the smallest, U=2, plans"),
    ([], "memory.plan_gpu=local, but this machine has no GPU: set memory.plan_gpu"),
])
def test_auto_refuses_in_one_line(overrides, message):
    proc = _dry_run(*overrides)
    assert proc.returncode == 2, proc.stdout[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr


def _train(rank, world_size):
    from tests.train_harness import SMALL, run_main

    return run_main(*SMALL, "train.steps=2", "parallel.upipe_heads_per_stage=auto", "memory.plan_gpu=h100-80gb")


def test_training_runs_with_the_chosen_u(capfd):
    for code, err in run_on_ranks(_train, 2, start_method="spawn"):  # spawned ranks write to capfd's file
        assert code == 0, err[-3000:]
    out = capfd.readouterr().out
    # tiny on 2 ranks at 64 tokens fits an H100 at any U: the largest legal U (8 query heads over cp 2), 1 stage
    assert "parallel.upipe_heads_per_stage=auto -> U=8 (1 stage)" in out


def test_unset_u_is_chosen_like_auto_and_is_the_smallest_without_a_gpu():
    """cp_strategy=upipe with upipe_heads_per_stage unset: the training job plans U as auto does when it has a device
    to plan against, and takes the smallest legal U (saying so) on a machine without a GPU and plan_gpu=local."""
    planned = _dry_run("parallel.upipe_heads_per_stage=null", "memory.plan_gpu=4.85")
    assert planned.returncode == 0, planned.stderr[-2000:]
    assert "parallel.upipe_heads_per_stage=auto -> U=4 (2 stages): the largest legal U whose plan fits" \
        in planned.stdout
    here = _dry_run("parallel.upipe_heads_per_stage=null")
    assert here.returncode == 0, here.stderr[-2000:]
    assert "parallel.upipe_heads_per_stage unset -> U=2, the smallest legal (the least attention memory): no GPU " \
           "here to plan against (memory.plan_gpu=local)" in here.stdout
    assert "upipe: 2 heads per stage (over the cp ranks), 4 stages" in here.stdout


def _choose_job(rank, world_size, overlap, peaks, speeds):
    """choose_heads_per_stage over stand-in plans: U -> (planned GiB, tokens/s); the device holds 10 GiB."""
    from types import SimpleNamespace

    from megatron_upipe.planner import choose_heads
    from megatron_upipe.planner.estimate import ConfigSource

    planned = []

    def estimate(source, world_size, vocab, strategy, seq, gpu, margins, jobs=1):
        U = int(strategy.split(":")[1])
        planned.append(U)
        return SimpleNamespace(peak_bytes=int(peaks[U] * 2**30), fits=peaks[U] <= 10, host_mem_bytes=0, U=U)

    choose_heads.estimate = estimate
    choose_heads.step_time = lambda est, world_size, hw: SimpleNamespace(tokens_per_s_per_gpu=speeds[est.U])
    source = ConfigSource(str(ROOT / "examples/configs/tiny_cpu.yaml"),
                          ("model.preset=small", f"memory.upipe_overlap={str(overlap).lower()}",
                           "parallel.upipe_heads_per_stage=auto"))
    choice = choose_heads.choose_heads_per_stage(source, 2, 4096, 10 * 2**30, None, hw=object())
    return choice.heads_per_stage, planned, choice.reason


def _choose_jobs(rank, world_size, calls):
    return [_choose_job(rank, world_size, *call) for call in calls]  # one process (each call re-patches)


def test_auto_takes_the_fastest_fitting_u_when_stages_are_pipelined():
    """small on cp 2: legal U 2, 4, 8. Serial stages: the largest that fits, planned from the largest down and no
    further. Pipelined stages (memory.upipe_overlap): every U planned, the fitting one with the most tokens/s."""
    peaks = {8: 12.0, 4: 9.0, 2: 7.0}
    speeds = {8: 300.0, 4: 200.0, 2: 250.0}
    serial, pipelined, tie = run_on_ranks(_choose_jobs, 1, [(False, peaks, speeds), (True, peaks, speeds),
                                                            (True, peaks, {8: 300.0, 4: 250.0, 2: 250.0})])[0]
    U, planned, _ = serial
    assert (U, planned) == (4, [8, 4])
    U, planned, reason = pipelined
    assert (U, planned) == (2, [8, 4, 2])
    assert "the fastest legal U whose plan fits" in reason and "U=4: 200" in reason and "U=8" in reason
    U, _, _ = tie
    assert U == 4  # a tie: the larger U
