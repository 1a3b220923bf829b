"""What a resumed, extended or interrupted run does: the data order, the LR schedule, when checkpoints are saved, and
the stop on SIGTERM / SIGUSR1.

The training split is cut to 15 samples of 64 tokens (data.split=[0.3, 99.6, 0.1]), so these few-step runs
(4 samples a step) cross epochs: megatron's own dataset, sized by train.steps, would shuffle 24 samples over 2 epochs
and 36 over 3 differently; the order must not depend on train.steps.

One 2-rank gloo job (pretrain_llama.main(), tiny Llama, cp=2 UPipe, float32 on CPU) runs:
  short     6 steps, checkpoints at 3 and 6;
  extended  resumes short's step 3 with train.steps=9: steps 4-6 equal short's bit for bit (same samples, and the
            checkpoint's schedule, which ends at step 6, so steps 7-9 run at min_lr), and the log says so;
  config    the same with checkpoint.scheduler=config: the LR of steps 4-9 is the config's cosine over 9 steps
            (a formula written here), and the log says which schedule is in effect;
  again     relaunches short at train.steps=6: "nothing to do", exit 0, nothing trained or saved;
  never     checkpoint.dir set, interval=0 and save_final=false: no checkpoint;
  straight  12 steps uninterrupted (the reference of the signal test);
  signalled 6 steps, rank 0 alone gets SIGUSR1 in step 2: both ranks save step 2 and main() returns 5 on both.
The signal tests launch torchrun (2 ranks) in a subprocess: a SIGTERM to torchrun mid-run stops every rank after
the same step with a published checkpoint and exit code 5, and a relaunch reproduces `straight` bit for bit; a
SIGUSR1 sent to every process of the job, as Slurm's --signal does, with the recipes' torchrun flags, does the same
after a periodic save has started megatron's checkpoint-writer helper process.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from tests.dist_helper import free_port, run_on_ranks
from tests.train_harness import DATA, ROOT, SMALL, TINY, losses, processes_with, read_metrics, run_main

SPLIT = "data.split=[0.3, 99.6, 0.1]"  # 15 training samples of 64 tokens
BASE = [*SMALL, SPLIT]
LR, MIN_LR = 3.0e-3, 3.0e-4  # tiny_cpu.yaml's; SMALL sets train.warmup_steps=1
STRAIGHT_STEPS = 12


def _run(tmp: Path, name: str, *overrides: str) -> tuple[int, str, str]:
    """run_main with stdout captured too: (exit code, stderr, stdout)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code, err = run_main(*BASE, f"checkpoint.dir={tmp}/{name}", f"log.metrics_file={tmp}/{name}.jsonl",
                             *overrides)
    return code, err, out.getvalue()


def _job(rank, world_size, tmp):
    import torch
    import torch.distributed as dist

    from megatron_upipe.training.agree import largest_on_any_rank
    from megatron_upipe.training.signals import StopOnSignal

    tmp = Path(tmp)
    stop = StopOnSignal()  # the agreement: only rank 1 saw a signal, both ranks learn it from one all-reduce
    agreed = [largest_on_any_rank([stop.received], torch.device("cpu"))[0]]
    if rank == 1:
        stop.received = int(signal.SIGUSR1)
    agreed.append(largest_on_any_rank([stop.received], torch.device("cpu"))[0])
    out = {"agreed": agreed}
    out["short"] = _run(tmp, "short", "train.steps=6", "checkpoint.interval=3")
    step3 = f"checkpoint.load={tmp}/short/iter_0000003"
    out["extended"] = _run(tmp, "extended", "train.steps=9", step3)
    out["config"] = _run(tmp, "config", "train.steps=9", step3, "checkpoint.scheduler=config")
    dist.barrier()
    before = sorted(p.name for p in (tmp / "short").iterdir())
    out["again"] = _run(tmp, "short", "train.steps=6", "checkpoint.interval=3")
    out["again_files"] = (before, sorted(p.name for p in (tmp / "short").iterdir()))
    out["never"] = _run(tmp, "never", "train.steps=2", "checkpoint.save_final=false")
    out["straight"] = _run(tmp, "straight", f"train.steps={STRAIGHT_STEPS}", "checkpoint.dir=null")
    out["signalled"] = _signalled_run(rank, tmp)
    return out


def _signalled_run(rank: int, tmp: Path):
    """A 6-step run in which rank 0 alone receives SIGUSR1 during step 2."""
    from megatron_upipe.training import loop

    orig = loop.train_step

    def train_step(state, data_iterator, *args):
        result = orig(state, data_iterator, *args)
        if rank == 0 and state.step + 1 == 2:
            os.kill(os.getpid(), signal.SIGUSR1)
        return result

    loop.train_step = train_step
    before = signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM)
    try:
        result = _run(tmp, "signalled", "train.steps=6")
    finally:
        loop.train_step = orig
    return (*result, before == (signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM)))


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("semantics")
    return tmp, run_on_ranks(_job, 2, str(tmp))


def _ok(per_rank, *names):
    for rank, out in enumerate(per_rank):
        for name in names:
            code, err, _ = out[name]
            assert code == 0, f"rank {rank}, run {name}: exit {code}\n{err}"


def _cosine(step: int, horizon: int) -> float:
    """The LR of `step` (1-based): warmup 1 step to LR, then cosine to MIN_LR at `horizon`, MIN_LR after."""
    if step <= 1:
        return LR * step
    if step > horizon:
        return MIN_LR
    return MIN_LR + (LR - MIN_LR) * 0.5 * (1 + math.cos(math.pi * (step - 1) / (horizon - 1)))


def test_the_sample_order_does_not_depend_on_train_steps(tmp_path):
    """The training samples of a 6-step run are the first ones of a 200-step run; epoch 0 is megatron's own
    one-epoch order, and a later epoch is a permutation of it."""
    import torch

    from megatron_upipe.config import load_config, validate
    from megatron_upipe.data.datasets import GPTDataConfig, build_gpt_datasets
    from megatron_upipe.training.data import build_run_datasets, build_run_tokenizer

    def train_set(steps: int):
        config = load_config(TINY, [*DATA, *BASE, f"train.steps={steps}", f"checkpoint.dir={tmp_path}/ckpt"])
        plan = validate(config, 2)
        tokenizer = build_run_tokenizer(config, plan)
        return build_run_datasets(config, plan, tokenizer)[0], config, tokenizer

    short, config, tokenizer = train_set(6)
    long, _, _ = train_set(200)
    assert (len(short), len(long), short.epoch_size) == (24, 800, 15)
    tokens = lambda ds, i: torch.as_tensor(ds[i]["tokens"])  # noqa: E731
    assert all(torch.equal(tokens(short, i), tokens(long, i)) for i in range(24))
    t = config.train
    megatron = build_gpt_datasets(GPTDataConfig(data_path=(config.data.path,), seq_length=t.seq_length, seed=t.seed,
                                                split=tuple(config.data.split)), tokenizer, (None, None, None),
                                  tmp_path / "cache").train
    assert len(megatron) == 15 and all(torch.equal(tokens(long, i), torch.as_tensor(megatron[i]["tokens"]))
                                       for i in range(15))
    second = [long.base_index(i) for i in range(15, 30)]
    assert sorted(second) == list(range(15)) and second != list(range(15))
    with pytest.raises(IndexError):
        long[800]


def test_an_extended_run_reproduces_the_shorter_one_and_keeps_its_schedule(job):
    tmp, per_rank = job
    _ok(per_rank, "short", "extended")
    short, extended = losses(tmp / "short.jsonl"), losses(tmp / "extended.jsonl")
    assert sorted(extended) == [4, 5, 6, 7, 8, 9]
    assert [extended[s] for s in (4, 5, 6)] == [short[s] for s in (4, 5, 6)]  # bit-identical
    lr = {r["step"]: r["lr"] for r in read_metrics(tmp / "extended.jsonl")}
    assert [lr[s] for s in (4, 5, 6)] == pytest.approx([_cosine(s, 6) for s in (4, 5, 6)], rel=1e-12)
    assert [lr[s] for s in (7, 8, 9)] == pytest.approx([MIN_LR] * 3, rel=1e-12)
    stdout = per_rank[0]["extended"][2]
    assert ("LR schedule: the checkpoint's (lr 0.003, min_lr 0.0003, warmup 1 steps, decay to step 6, cosine); "
            "steps 7-9 run at min_lr 0.0003 (train.steps=9); the config asks for decay to step 9: set "
            "checkpoint.scheduler=config to follow the config") in stdout, stdout
    # checkpoint.interval=0: the end of the run is saved (checkpoint.save_final), nothing else
    assert sorted(p.name for p in (tmp / "extended").iterdir()) == ["iter_0000009", "latest"]


def test_checkpoint_scheduler_config_follows_the_config(job):
    tmp, per_rank = job
    _ok(per_rank, "config")
    lr = {r["step"]: r["lr"] for r in read_metrics(tmp / "config.jsonl")}
    assert sorted(lr) == [4, 5, 6, 7, 8, 9]
    assert [lr[s] for s in sorted(lr)] == pytest.approx([_cosine(s, 9) for s in sorted(lr)], rel=1e-12)
    assert _cosine(5, 9) != pytest.approx(_cosine(5, 6))  # the two schedules do differ there
    cfg, short = losses(tmp / "config.jsonl"), losses(tmp / "short.jsonl")
    assert cfg[4] == short[4] and cfg[5] != short[5]  # same weights and samples at step 4, another LR from it on
    stdout = per_rank[0]["config"][2]
    assert ("LR schedule: the config's (lr 0.003, min_lr 0.0003, warmup 1 steps, decay to step 9, cosine), by "
            "checkpoint.scheduler=config; the checkpoint had decay to step 6 (checkpoint.scheduler=checkpoint keeps "
            "it)") in stdout, stdout


def test_a_resume_past_train_steps_says_there_is_nothing_to_do(job):
    tmp, per_rank = job
    _ok(per_rank, "again")
    stdout = per_rank[0]["again"][2]
    assert "nothing to do: checkpoint at step 6 >= train.steps=6; raise train.steps to continue" in stdout, stdout
    before, after = per_rank[0]["again_files"]
    assert before == after == ["iter_0000003", "iter_0000006", "latest"]
    assert sorted(losses(tmp / "short.jsonl")) == [1, 2, 3, 4, 5, 6]  # nothing appended
    assert "saved checkpoint" not in stdout


def test_interval_0_and_save_final_false_never_save(job):
    tmp, per_rank = job
    _ok(per_rank, "never")
    assert sorted(losses(tmp / "never.jsonl")) == [1, 2]
    assert not (tmp / "never").exists()


def test_stop_signals_are_recorded_only_while_active_and_agreed_by_all_ranks(job):
    from megatron_upipe.training.signals import StopOnSignal

    _, per_rank = job
    assert [out["agreed"] for out in per_rank] == [[0, int(signal.SIGUSR1)]] * 2
    previous = signal.getsignal(signal.SIGUSR1)
    with StopOnSignal() as stop:
        os.kill(os.getpid(), signal.SIGUSR1)
        deadline = time.monotonic() + 5
        while not stop.received and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stop.received == signal.SIGUSR1
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert stop.received == signal.SIGUSR1  # the first signal is kept
    assert signal.getsignal(signal.SIGUSR1) is previous
    holder = []
    thread = threading.Thread(target=lambda: holder.append(StopOnSignal().__enter__()._previous))
    thread.start()
    thread.join()
    assert holder == [{}]  # outside the main thread Python cannot install handlers: nothing is touched


def test_a_signal_to_one_rank_stops_all_after_the_same_step_with_a_checkpoint_and_exit_5(job):
    tmp, per_rank = job
    codes = [out["signalled"][0] for out in per_rank]
    assert codes == [5, 5], [out["signalled"][1] for out in per_rank]
    err = per_rank[0]["signalled"][1]
    assert (f"pretrain_llama.py: stopped by SIGUSR1 after step 2 of 6: checkpoint {tmp / 'signalled' / 'iter_0000002'} "
            f"saved; exit code 5; relaunch the same command to resume from step 2") in err, err
    assert "stopped by" not in per_rank[1]["signalled"][1]  # one line, from rank 0
    assert sorted(losses(tmp / "signalled.jsonl")) == [1, 2]
    assert (tmp / "signalled" / "latest").read_text().strip() == "iter_0000002"
    assert all(out["signalled"][3] for out in per_rank)  # the handlers were put back after the run


def _blocked_signals(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("SigBlk:")).split()[1], 16)


def test_processes_started_during_a_save_do_not_see_stop_signals():
    import multiprocessing

    from megatron_upipe.training.signals import STOP_SIGNALS, StopOnSignal, blocked_in_children

    bits = sum(1 << (int(s) - 1) for s in STOP_SIGNALS)
    with StopOnSignal() as stop:
        with blocked_in_children():
            manager = multiprocessing.get_context("spawn").Manager()  # as megatron's checkpoint writer does
            try:
                child = manager._process.pid
                assert _blocked_signals(child) & bits == bits
            finally:
                manager.shutdown()
            os.kill(os.getpid(), signal.SIGUSR1)  # arrives while blocked here: recorded, not lost
        deadline = time.monotonic() + 5
        while not stop.received and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stop.received == signal.SIGUSR1
    assert _blocked_signals(os.getpid()) & bits == 0


# -- torchrun launches ------------------------------------------------------------------------------------------

def _launch(tmp: Path, overrides: list[str], torchrun_args: list[str] = (), signal_at: int | None = None,
            send=None) -> tuple[int, str]:
    """torchrun, 2 ranks, pretrain_llama.py; with `signal_at`, `send(proc, token)` is called once the metrics file
    holds that many steps. Returns (torchrun's exit code, its output). Leftover processes of the launch (found by a
    token in their environment) are killed afterwards."""
    token = f"UPIPE_SIGNAL_TEST_{uuid.uuid4().hex}"
    metrics = tmp / "metrics.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           *torchrun_args, str(ROOT / "pretrain_llama.py"), "--config", TINY, *DATA, *BASE,
           f"train.steps={STRAIGHT_STEPS}", f"checkpoint.dir={tmp}/ckpt", f"log.metrics_file={metrics}",
           "dist.timeout_s=60", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", token: "1"}
    seen = len(read_metrics(metrics)) if metrics.exists() else 0
    log = tmp / f"launch{seen}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            if signal_at is not None:
                deadline = time.monotonic() + 240
                while proc.poll() is None and time.monotonic() < deadline:
                    with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
                        if len(read_metrics(metrics)) - seen >= signal_at:
                            send(proc, token)
                            break
                    time.sleep(0.02)
            code = proc.wait(timeout=300)
        finally:
            proc.kill()
            for pid in processes_with(token):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    return code, log.read_text()


def _stopped_step(output: str, name: str, ckpt: Path) -> int:
    lines = [line for line in output.splitlines() if f"stopped by {name} after step" in line]
    assert len(lines) == 1, output[-4000:]  # one line (rank 0), naming the signal, the step and the checkpoint
    step = int(lines[0].split("after step ")[1].split()[0])
    assert (f"stopped by {name} after step {step} of {STRAIGHT_STEPS}: checkpoint {ckpt / f'iter_{step:07d}'} "
            f"saved; exit code 5; relaunch the same command to resume from step {step}") in lines[0]
    return step


def test_sigterm_to_torchrun_saves_exits_5_and_the_relaunch_resumes_exactly(job, tmp_path):
    ckpt = tmp_path / "ckpt"
    code, output = _launch(tmp_path, [], signal_at=2, send=lambda proc, _: proc.send_signal(signal.SIGTERM))
    step = _stopped_step(output, "SIGTERM", ckpt)
    assert 2 <= step < STRAIGHT_STEPS
    assert code != 0  # torchrun itself, signalled, ends with its SignalException (the ranks' 5 is tested in-process)
    assert (ckpt / "latest").read_text().strip() == f"iter_{step:07d}"
    assert sorted(p.name for p in ckpt.iterdir()) == [f"iter_{step:07d}", "latest"]
    first = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in first] == list(range(1, step + 1))

    code, output = _launch(tmp_path, [])
    assert code == 0, output[-4000:]
    assert f"resumed from {ckpt / f'iter_{step:07d}'} at step {step}" in output
    resumed = read_metrics(tmp_path / "metrics.jsonl")[len(first):]
    assert [r["step"] for r in resumed] == list(range(step + 1, STRAIGHT_STEPS + 1))
    _, per_rank = job
    _ok(per_rank, "straight")
    straight = losses(job[0] / "straight.jsonl")
    assert [r["loss"] for r in first + resumed] == [straight[s] for s in range(1, STRAIGHT_STEPS + 1)]


def test_sigusr1_to_every_process_as_slurm_sends_it_saves_and_exits_5(tmp_path):
    """Slurm's --signal=USR1@T signals every process of the job step: torchrun (which must forward it, not die:
    the recipes' torchrun flags) and each rank, here after a periodic save at step 2 started megatron's
    checkpoint-writer helper process in each rank."""
    recipe = (ROOT / "examples" / "slurm" / "llama3_8b_upipe_8xh100.sbatch").read_text()
    launch = (ROOT / "examples" / "slurm" / "launch.sh").read_text()  # the batch scripts' shared body
    assert "#SBATCH --signal=USR1@" in recipe and "--signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1" in launch

    def everyone(proc, token):
        # once to each process, as Slurm does: torchrun's own environment carries the token too, and a second
        # SIGUSR1 arriving while torchrun forwards the first makes it escalate to SIGTERM
        for pid in dict.fromkeys([proc.pid, *processes_with(token)]):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGUSR1)

    ckpt = tmp_path / "ckpt"
    code, output = _launch(tmp_path, ["checkpoint.interval=2"],
                           ["--signals-to-handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1", "--shutdown-timeout", "120"],
                           signal_at=3, send=everyone)
    step = _stopped_step(output, "SIGUSR1", ckpt)
    assert 3 <= step < STRAIGHT_STEPS and code != 0
    assert (ckpt / "latest").read_text().strip() == f"iter_{step:07d}"
    assert (ckpt / f"iter_{step:07d}" / "train_state.json").is_file()
    meta = json.loads((ckpt / f"iter_{step:07d}" / "train_state.json").read_text())
    assert (meta["step"], meta["consumed_samples"]) == (step, 4 * step)
