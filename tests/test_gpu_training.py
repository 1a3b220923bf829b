"""Training on a CUDA GPU: pretrain_llama.py on one GPU (NCCL, cp=1 UPipe, bf16, the long recipes' memory stack)
takes steps, every parameter lives on the GPU, and memory.plan_check's prediction is within 1% of
torch.cuda.max_memory_allocated, with the offloaded layer inputs prefetched a layer ahead (the CUDA side streams of
memory_switches/offload.py). Runs wherever a CUDA GPU is visible; CI's machines have none. The same run at full
Llama3-8B layer dims is the training part of tools/gpu_check.sh (docs/gpu_results.md has its numbers): it is where
the model was found left half on the CPU (megatron-core's local-spec norms) before build_stage moved it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on CI's machines)")


def test_one_gpu_training_with_the_memory_switches_and_plan_check(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port", "29561",
           str(ROOT / "pretrain_llama.py"), "--config", str(ROOT / "tools" / "gpu_check_train.yaml"),
           "model.num_layers=2", "model.hidden_size=512", "model.ffn_hidden_size=1024", "model.vocab_size=4096",
           "train.seq_length=8192", "memory.offload_prefetch=true", f"log.metrics_file={metrics}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3] and all(r["peak_mem_kind"] == "cuda_max_allocated" for r in train)
    check = [r for r in records if r["kind"] == "memory"]
    assert len(check) == 1 and abs(check[0]["rel_diff"]) < 0.01, check


def test_parked_optimizer_states_leave_the_gpu_and_come_back_bit_for_bit():
    """memory.offload_optimizer_states on CUDA: torch's Adam over 64 MiB of float32 parameters on the GPU; parking
    frees its moments from torch.cuda.memory_allocated into pinned host buffers, and the steps after it equal a run
    without parking bit for bit (the copies run on the current stream, in order with the step's kernels)."""
    from megatron_upipe.memory_switches.optimizer_parking import ParkedStates, optimizer_own_tensors, parked

    def run(park: bool) -> list[torch.Tensor]:
        gen = torch.Generator(device="cuda").manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(1024, 4096, device="cuda", generator=gen)) for _ in range(4)]
        opt = torch.optim.Adam(params, lr=1e-2)
        states = ParkedStates(lambda: optimizer_own_tensors(opt, params), pin=True) if park else None
        for step in range(3):
            before = torch.cuda.memory_allocated()
            with parked(states):
                if park and step:  # Adam's moments exist from the first step on: 2 x 64 MiB parked
                    assert states.pinned and states.parked_bytes == 2 * 4 * 1024 * 4096 * 4
                    assert before - torch.cuda.memory_allocated() == states.parked_bytes
                loss = sum((p * p).sum() for p in params) * (step + 1)
                loss.backward()
            opt.step()
            opt.zero_grad()
        torch.cuda.synchronize()
        return [p.detach().cpu() for p in params]

    for a, b in zip(run(False), run(True)):
        assert torch.equal(a, b)
