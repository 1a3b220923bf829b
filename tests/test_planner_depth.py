"""The planner's depth extrapolation (planner/depth.py) equals the full simulation of the deep model."""

from __future__ import annotations

import pytest

from megatron_upipe.config import load_config
from tests.dist_helper import run_on_ranks

VOCAB = 256
BASE = [f"model.vocab_size={VOCAB}", "data.path=mock", "dist.backend=gloo", "train.micro_batch_size=1",
        "model.preset=tiny-gqa", "model.num_layers=8"]
# bf16 (a GPU plan), the long recipes' stack and plain DDP; 4 ranks of a fake world each
LONG_STACK = ["parallel.cp=4", "parallel.cp_strategy=upipe", "train.seq_length=2048", "memory.recompute=full",
              "memory.offload_checkpoints=true", "memory.mlp_chunks=4", "memory.loss_chunks=4",
              "memory.shard_model_states=true", "train.bf16=true"]
CASES = {
    "upipe cp4, sharded states, full recompute + offload, tiled MLP, chunked loss, bf16 grad accum": [
        *LONG_STACK, "memory.attention_grad_accum=input"],
    "ulysses cp2 x dp2, distributed optimizer, no recompute": [
        "parallel.cp=2", "parallel.cp_strategy=ulysses", "train.seq_length=1024", "train.distributed_optimizer=true",
        "train.global_batch_size=2"],
    "upipe cp4, sharded states, recompute 3 of 8 layers + offload, tiled MLP, chunked loss": [
        *LONG_STACK, "memory.recompute_layers=3"],
    "ulysses cp2 x dp2, recompute 2 of 8 layers": [
        "parallel.cp=2", "parallel.cp_strategy=ulysses", "train.seq_length=1024", "memory.recompute=full",
        "memory.recompute_layers=2", "train.global_batch_size=2"],
    "pp2 x cp2 upipe, full recompute": [
        "parallel.pp=2", "parallel.cp=2", "parallel.cp_strategy=upipe", "train.seq_length=1024",
        "memory.recompute=full", "train.global_batch_size=2"],
}


PARTIAL = "upipe cp4, sharded states, recompute 3 of 8 layers + offload, tiled MLP, chunked loss"
SIDE_BY_SIDE = "upipe cp4, sharded states, full recompute + offload, tiled MLP, chunked loss, bf16 grad accum"


def _both(rank, world_size):
    import torch.distributed as dist

    from megatron_upipe.planner.depth import simulate_deep
    from megatron_upipe.planner.simulate import simulate_step

    from megatron_upipe.planner.workers import fork_usable

    dist.destroy_process_group()  # the planner makes its own fake one
    config = load_config(None, BASE + CASES[SIDE_BY_SIDE])
    out = {"forked": fork_usable()}  # before any backward in this process
    out["side by side"] = [simulate_deep(config, 4, VOCAB, named_bytes=1024, jobs=jobs) for jobs in (2, 1)]
    out["forked after a backward"] = fork_usable()
    for case, overrides in CASES.items():
        config = load_config(None, BASE + overrides)
        out[case] = (simulate_step(config, 4, VOCAB), simulate_deep(config, 4, VOCAB))
    memo = {}  # another recompute depth of the same stack first: its three shallow simulations are the same
    simulate_deep(load_config(None, BASE + [*LONG_STACK, "memory.recompute_layers=5"]), 4, VOCAB, memo=memo)
    simulated = len(memo)
    out["memo"] = (simulated, simulate_deep(load_config(None, BASE + CASES[PARTIAL]), 4, VOCAB, memo=memo), len(memo))
    return out


@pytest.fixture(scope="module")
def simulated():
    return run_on_ranks(_both, 1, start_method="spawn")[0]  # the rank forks simulation workers (dist_helper.py)


@pytest.mark.parametrize("case", sorted(CASES))
def test_extrapolated_step_equals_the_full_simulation(simulated, case):
    full, deep = simulated[case]
    for field in ("peak_bytes", "attention_peak_bytes", "host_peak_bytes", "model_state_bytes", "num_parameters"):
        f, d = getattr(full, field), getattr(deep, field)
        assert abs(d - f) <= 0.005 * max(f, 1), f"{case}: {field} extrapolated {d} vs simulated {f}"
    assert full.peak_bytes > 0 and full.num_parameters > 0
    assert sum(deep.breakdown.values()) == deep.peak_bytes


def test_simulations_side_by_side_equal_one_after_the_other(simulated):
    """jobs=2 (two forked workers, planner/workers.py) returns the serial result, named buffers included; once the
    process has run a backward, forked children could not, and the simulations run serially."""
    assert simulated["forked"] and not simulated["forked after a backward"]
    side_by_side, serial = simulated["side by side"]
    assert side_by_side == serial and serial.peak_named and serial.peak_bytes == simulated[SIDE_BY_SIDE][1].peak_bytes


def test_a_search_reuses_the_shallow_simulations_of_another_recompute_depth(simulated):
    """depth.simulations' memo: recompute 3 of 8 after 5 of 8 simulates nothing more, and equals its own
    simulations made afresh."""
    simulated_first, deep, simulated_after = simulated["memo"]
    assert simulated_first == simulated_after == 3
    assert deep == simulated[PARTIAL][1]


def test_a_shallow_config_is_simulated_whole():
    from megatron_upipe.planner.depth import extrapolate
    from megatron_upipe.planner.simulate import StepMemory

    a = StepMemory(100, {"params": 60, "other": 40}, 10, 60, 8, 6)
    b = StepMemory(130, {"params": 90, "other": 40}, 15, 90, 8, 9)
    d = extrapolate(a, b, 2, 3, 10)
    assert (d.peak_bytes, d.host_peak_bytes, d.model_state_bytes, d.num_parameters) == (340, 50, 300, 30)
    assert d.breakdown == {"params": 300, "other": 40}
    with pytest.raises(ValueError, match="0 < a < b"):
        extrapolate(a, b, 3, 2, 10)
