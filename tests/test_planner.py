"""The memory planner: its fake-tensor simulation of rank 0 equals the tracked peak of the real run (gloo, real
tensors, same code) within 1%, and tools/estimate_memory.py searches, reports and plots as documented."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_upipe.config import load_config, validate
from tests.dist_helper import run_on_ranks

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 256

# Small CPU configs in float32 (the planner's default is bf16: a GPU plan), 2 ranks.
CASES = {
    "upipe cp2, full recompute, tiled MLP, chunked loss": [
        "model.preset=tiny-gqa", "parallel.cp=2", "parallel.cp_strategy=upipe", "train.seq_length=512",
        "memory.recompute=full", "memory.mlp_chunks=4", "memory.loss_chunks=4"],
    "upipe cp2, packed documents, full recompute, tiled MLP, chunked loss": [
        "model.preset=tiny-gqa", "parallel.cp=2", "parallel.cp_strategy=upipe", "train.seq_length=512",
        "memory.recompute=full", "memory.mlp_chunks=4", "memory.loss_chunks=4", "data.document_mask=true"],
    "upipe cp2 pipelined stages, full recompute, offload prefetched a layer ahead": [
        "model.preset=tiny-gqa", "parallel.cp=2", "parallel.cp_strategy=upipe", "train.seq_length=512",
        "memory.recompute=full", "memory.upipe_overlap=true", "memory.offload_checkpoints=true",
        "memory.offload_prefetch=true"],
    "upipe cp 1x2 (a ring of 2, parallel.cp_ring), recompute 1 of 2 layers, tiled MLP, residual gradient in place": [
        "model.preset=tiny-gqa", "parallel.cp=2", "parallel.cp_ring=2", "parallel.cp_strategy=upipe",
        "train.seq_length=512", "memory.recompute=full", "memory.recompute_layers=1", "memory.mlp_chunks=4",
        "memory.residual_grad_in_place=true"],
    "ulysses cp 1x2, ring passes overlapped (memory.ring_overlap), no recompute": [
        "model.preset=tiny-gqa", "parallel.cp=2", "parallel.cp_ring=2", "parallel.cp_strategy=ulysses",
        "train.seq_length=512", "memory.ring_overlap=true"],
    "ulysses cp2 x dp1, no recompute": [
        "model.preset=tiny-gqa", "parallel.cp=2", "parallel.cp_strategy=ulysses", "train.seq_length=512"],
    "tp2 + sequence parallel, upipe off": [
        "model.preset=tiny-gqa", "parallel.tp=2", "parallel.sequence_parallel=true", "train.seq_length=256"],
}
BASE = ["train.bf16=false", f"model.vocab_size={VOCAB}", "data.path=mock", "dist.backend=gloo",
        "train.micro_batch_size=1"]


def _config(case):
    return load_config(None, BASE + CASES[case])


def _simulate_all(rank, world_size):
    from megatron_upipe.planner.simulate import simulate_step

    torch.distributed.destroy_process_group()  # the planner makes its own fake one
    return {case: simulate_step(_config(case), 2, VOCAB) for case in CASES}


def measure_real(config, world_size: int, vocab: int, *, bf16: bool):
    """The tracked step of this rank on real tensors and the run's process groups: what the simulation must equal."""
    from megatron_upipe.parallel import destroy_parallel, initialize_parallel
    from megatron_upipe.planner.simulate import _layout, measure_step

    plan = validate(config, world_size)
    layout = _layout(config, plan)
    pg = initialize_parallel(layout, seed=config.train.seed)
    try:
        return measure_step(config, plan, layout, pg, vocab, bf16=bf16, planning=False)
    finally:
        destroy_parallel()


def _real_all(rank, world_size):
    return {case: measure_real(_config(case), world_size, VOCAB, bf16=False) for case in CASES}


@pytest.fixture(scope="module")
def simulated():
    return run_on_ranks(_simulate_all, 1)[0]


@pytest.fixture(scope="module")
def real_runs():
    """Every case's real step, one after another in one world of 2 ranks (one spawn)."""
    return run_on_ranks(_real_all, 2)[0]


@pytest.mark.parametrize("case", sorted(CASES))
def test_simulation_matches_real_run_within_1_percent(simulated, real_runs, case):
    real = real_runs[case]
    sim = simulated[case]
    err = abs(sim.peak_bytes - real.peak_bytes) / real.peak_bytes
    assert err < 0.01, f"{case}: simulated {sim.peak_bytes} vs real {real.peak_bytes} ({err:.2%})"
    assert sim.model_state_bytes == real.model_state_bytes
    assert sum(sim.breakdown.values()) == sim.peak_bytes
    assert {"params", "grads", "optimizer"} <= set(sim.breakdown)


def test_packed_documents_cost_no_rotary_table(simulated):
    """data.document_mask: the layers share one tensor of RoPE angles for this rank's [s/C] positions, as unpacked;
    a table of the longest document's rows (up to N) would add (N - N/C) · rot_dim · 4 bytes."""
    packed = simulated["upipe cp2, packed documents, full recompute, tiled MLP, chunked loss"]
    plain = simulated["upipe cp2, full recompute, tiled MLP, chunked loss"]
    table = (512 - 256) * 8 * 4  # tiny-gqa: rot_dim = kv_channels = 8
    assert 0 <= packed.peak_bytes - plain.peak_bytes < table // 4, (packed.peak_bytes, plain.peak_bytes)


def _simulate_as_on_a_gpu_machine(rank, world_size, case):
    torch.distributed.destroy_process_group()  # the planner makes its own fake one
    torch.cuda.is_available = lambda: True  # what a GPU node answers (no CUDA call follows in this process)
    from megatron_upipe.planner.simulate import simulate_step

    step = simulate_step(_config(case), 2, VOCAB)
    return step, torch.cuda.is_available()


def test_planner_on_a_gpu_machine_simulates_the_same_step(simulated):
    """On a GPU node (memory.plan_check, upipe_heads_per_stage=auto, estimate_memory.py there) the planner used to
    build megatron-core's linear weights as CUDA tensors and its norms on the CPU, and the optimizer refused them
    (found on a lent H200). It now plans along the CPU path whatever the machine has: same bytes as here."""
    case = next(iter(CASES))
    step, available_after = run_on_ranks(_simulate_as_on_a_gpu_machine, 1, case)[0]
    assert available_after is False  # the planning process is patched as a machine without a GPU
    assert step.peak_bytes == simulated[case].peak_bytes
    assert step.breakdown == simulated[case].breakdown


def test_estimate_memory_cli_max_context_json_and_plot(tmp_path):
    out, png = tmp_path / "plan.json", tmp_path / "plan.png"
    proc = subprocess.run(
        [sys.executable, "tools/estimate_memory.py", "--config", "examples/configs/tiny_cpu.yaml",
         "--world-size", "2", "--gpu", "2.75", "--strategies", "ulysses,upipe", "--max-context",
         "--max-tokens", str(4 * 1024 * 1024), "--cuda-context-gib", "0", "--nccl-gib", "0",
         "--json", str(out), "--plot", str(png), "model.vocab_size=256", "train.micro_batch_size=1",
         "train.global_batch_size=1"],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert set(data["max_context"]) == {"ulysses", "upipe"}
    # tiny model, 2.75 GiB "GPUs": UPipe's smaller attention intermediates buy a longer context than Ulysses
    assert data["max_context"]["upipe"] > data["max_context"]["ulysses"] > 0
    for r in data["results"]:
        assert {"strategy", "seq_length", "peak_bytes", "fits", "breakdown"} <= set(r)
        assert r["fits"] == (r["peak_bytes"] <= 2.75 * 2**30)
    best = max(r["seq_length"] for r in data["results"] if r["strategy"] == "upipe" and r["fits"])
    assert best == data["max_context"]["upipe"]
    assert png.stat().st_size > 10_000
    assert "max context per strategy" in proc.stdout


def _train_with_plan_check(rank, world_size, metrics):
    from tests.train_harness import SMALL, run_main

    code, err = run_main(*SMALL, "memory.plan_check=true", "train.steps=2", f"log.metrics_file={metrics}")
    assert code == 0, err[-3000:]


def test_training_log_puts_the_planner_prediction_beside_the_measured_peak(tmp_path):
    from tests.train_harness import read_metrics

    metrics = tmp_path / "metrics.jsonl"
    run_on_ranks(_train_with_plan_check, 2, str(metrics))
    [record] = read_metrics(metrics, kind="memory")
    assert record["step"] == 2 and record["measured_kind"] == "tracked"
    assert record["measured_peak_bytes"] > 0
    assert abs(record["rel_diff"]) < 0.01, record


CURVES = {  # peak GiB as a function of the length in 128K steps: linear, convex, kinked, flat, hopeless, jumping
    "linear": lambda k: 24 + 0.9 * k,
    "convex": lambda k: 24 + 0.9 * k + 0.004 * k * k,
    "kinked": lambda k: 24 + 0.9 * k + (0 if k < 40 else 0.5 * (k - 40)),
    "flat": lambda k: 30 + 0.1 * k,
    "hopeless": lambda k: 90 + k,
    "jump": lambda k: 24 + 0.9 * k + (3 if k > 50 else 0),
}


@pytest.mark.parametrize("curve", sorted(CURVES))
@pytest.mark.parametrize("gpu_gib", [24.95, 40, 80, 200])
def test_max_context_search_equals_brute_force(monkeypatch, curve, gpu_gib):
    """The search (aim, gallop, false position) returns the longest fitting multiple of 128K, proven by
    simulations on both sides, on any increasing peak curve; a handful of simulations, never one twice."""
    from megatron_upipe.planner import estimate as E

    f, calls, top = CURVES[curve], [], 512

    def fake_estimate(source, world, vocab, strategy, seq, gpu_mem, margins, jobs=1):
        k = seq // E.CONTEXT_STEP
        calls.append(k)
        peak = int(f(k) * E.GIB)
        return E.Estimate(strategy, seq, peak, peak <= gpu_mem, {}, 0, gpu_mem)

    monkeypatch.setattr(E, "estimate", fake_estimate)
    tokens, seen = E.max_context(None, 8, VOCAB, "upipe", int(gpu_gib * E.GIB), limit=top * E.CONTEXT_STEP,
                                 log=lambda *a: None)
    best = max((k for k in range(1, top + 1) if f(k) <= gpu_gib), default=0)
    assert tokens == best * E.CONTEXT_STEP
    assert len(calls) == len(set(calls)) <= 8
    if 0 < best < top:
        assert {best, best + 1} <= set(calls)  # both sides simulated
