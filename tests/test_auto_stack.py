"""memory.auto=fastest|longest: at start-up every rank asks the planner for the whole stack (U, pipelined stages,
memory switches), applies its overrides, logs them with the predicted memory and time (also in --dry-run), and
refuses in one line when nothing fits or there is no device to plan against. Which stack --fastest picks is
tests/test_fastest.py's subject; here, the job's side.

The shape: the `tiny` preset on cp 2 at 16K tokens, float32, planned against memory.plan_gpu=3.06 GiB with the
stated margins (1 GiB CUDA context, 2 GiB NCCL, 5%): about 0.03 GiB left for the step, where keeping every
activation does not fit and the tiled MLP and loss with ZeRO-3 do.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHAPE = ["model.vocab_size=512", "data.path=mock", "data.tokenizer=null", "train.seq_length=16384",
         "train.micro_batch_size=1", "train.global_batch_size=1", "memory.plan_check=false"]
FASTEST = ("memory.recompute=none memory.recompute_layers=null memory.offload_checkpoints=false "
           "memory.offload_prefetch=false memory.mlp_chunks=8 memory.loss_chunks=16 memory.shard_model_states=true "
           "memory.upipe_overlap=false parallel.upipe_heads_per_stage=8")


def _pretrain(*overrides, torchrun: bool = False, dry_run: bool = False, timeout: int = 600):
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29581"] \
        if torchrun else [sys.executable]
    flags = ["--dry-run", "--world-size", "2"] if dry_run else []
    return subprocess.run([*launch, "pretrain_llama.py", "--config", "examples/configs/tiny_cpu.yaml", *flags, *SHAPE,
                           *overrides],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_fastest_is_chosen_logged_and_trained(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    proc = _pretrain("memory.auto=fastest", "memory.plan_gpu=3.06", "train.steps=1", "train.eval_interval=0",
                     "checkpoint.dir=null", "checkpoint.interval=0", f"log.metrics_file={metrics}", torchrun=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (note,) = [line for line in proc.stdout.splitlines() if "memory.auto=fastest ->" in line]  # rank 0 says it once
    assert f"memory.auto=fastest -> {FASTEST}: planned 3.0" in note and "GiB per GPU" in note, note
    assert "step-time model (h100-80gb):" in note and "(the config as set:" in note
    assert [json.loads(r)["step"] for r in metrics.read_text().splitlines() if '"train"' in r] == [1]


def test_longest_dry_run_shows_the_most_frugal_stack():
    proc = _pretrain("memory.auto=longest", "memory.plan_gpu=h100-80gb", dry_run=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (note,) = [line for line in proc.stdout.splitlines() if line.startswith("memory.auto=longest -> ")]
    for setting in ("memory.recompute=full", "memory.offload_checkpoints=true", "memory.offload_prefetch=false",
                    "memory.shard_model_states=true", "memory.upipe_overlap=false",
                    "parallel.upipe_heads_per_stage=2"):  # the smallest legal U
        assert setting in note, (setting, note)
    assert "upipe: 2 heads per stage (over the cp ranks), 4 stages" in proc.stdout


@pytest.mark.parametrize("overrides, message", [
    (["memory.plan_gpu=3.0"], "memory.auto=fastest: --fastest: no stack fits 3.00 GiB per GPU at "
                              "train.seq_length=16384: the most frugal (memory.recompute=full"),
    (["memory.plan_gpu=local"], "memory.auto=fastest plans against memory.plan_gpu=local, but this machine has no "
                                "GPU: set memory.plan_gpu"),
])
def test_refuses_in_one_line(overrides, message):
    proc = _pretrain("memory.auto=fastest", *overrides, dry_run=True)
    assert proc.returncode == 2, proc.stdout[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
