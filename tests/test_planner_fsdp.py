"""The memory planner on the long recipes' whole stack, Megatron-FSDP (memory.shard_model_states) included: its
fake-tensor simulation of rank 0 equals the tracked peak of the real run (gloo, real tensors, same code) within 1%;
the storage tracker follows Megatron-FSDP's in-place bucket resizes; the training log's memory check works with
Megatron-FSDP."""

from __future__ import annotations

import pytest
import torch

from megatron_upipe.config import load_config, validate
from tests.dist_helper import run_on_ranks

VOCAB = 256
STACK = ["memory.recompute=full", "memory.offload_checkpoints=true", "memory.mlp_chunks=2", "memory.loss_chunks=2"]
FSDP = ["memory.shard_model_states=true"]
# bf16 (what the recipes run; CPU runs it too), 3 layers (so a layer is prefetched while another computes), 4 ranks.
BASE = ["train.bf16=true", f"model.vocab_size={VOCAB}", "data.path=mock", "dist.backend=gloo", "model.preset=tiny-gqa",
        "model.num_layers=3", "train.micro_batch_size=1", "train.seq_length=128"]
CASES = {  # name: (world size, overrides); the fused input norm / output projection are on wherever they apply
    "upipe cp2 x dp2, fsdp": (4, ["parallel.cp=2", "parallel.cp_strategy=upipe", *STACK, *FSDP,
                                  "memory.attention_grad_accum=input"]),
    "ulysses cp2 x dp2, fsdp": (4, ["parallel.cp=2", "parallel.cp_strategy=ulysses", *STACK, *FSDP,
                                    "memory.attention_grad_accum=input"]),
    "tp2 + sp x cp2 upipe, fsdp": (4, ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.cp=2",
                                       "parallel.cp_strategy=upipe", *STACK, *FSDP]),
    # Megatron-FSDP is not combined with pipeline parallelism here (wrap_fully_sharded refuses it): DDP
    "pp2 x cp2 upipe, ddp": (4, ["parallel.pp=2", "model.num_layers=4", "parallel.cp=2", "parallel.cp_strategy=upipe",
                                 "train.global_batch_size=4", *STACK]),
}


def _config(case):
    return load_config(None, BASE + CASES[case][1])


def _simulate_all(rank, world_size):
    import time

    from megatron_upipe.planner.simulate import simulate_step

    torch.distributed.destroy_process_group()  # the planner makes its own fake one
    out = {}
    for case, (world, _) in CASES.items():
        start = time.perf_counter()
        out[case] = (simulate_step(_config(case), world, VOCAB), time.perf_counter() - start)
    return out


def _real(rank, world_size, case):
    from megatron_upipe.parallel import destroy_parallel, initialize_parallel
    from megatron_upipe.planner.simulate import _layout, measure_step

    config = _config(case)
    plan = validate(config, world_size)
    layout = _layout(config, plan)
    pg = initialize_parallel(layout, seed=config.train.seed)
    try:
        return measure_step(config, plan, layout, pg, VOCAB, bf16=True, planning=False)
    finally:
        destroy_parallel()


@pytest.fixture(scope="module")
def simulated():
    return run_on_ranks(_simulate_all, 1)[0]


@pytest.mark.parametrize("case", list(CASES))
def test_simulation_matches_real_run_within_1_percent(simulated, case):
    sim, seconds = simulated[case]
    real = run_on_ranks(_real, CASES[case][0], case)[0]
    err = abs(sim.peak_bytes - real.peak_bytes) / real.peak_bytes
    assert err < 0.01, f"{case}: simulated {sim.peak_bytes} vs real {real.peak_bytes} ({err:.2%}), {seconds:.0f} s"
    assert sim.model_state_bytes == real.model_state_bytes
    assert sum(sim.breakdown.values()) == sim.peak_bytes
    fsdp = {"fsdp: gathered params", "fsdp: grad buckets"}
    if "fsdp" in case:  # the sharded wrapper itself was simulated: its unsharded buckets are alive at the peak
        assert fsdp <= set(sim.breakdown) and fsdp <= set(real.breakdown), sim.breakdown
    else:
        assert not fsdp & set(sim.breakdown)


def test_storage_tracker_follows_in_place_resizes_and_split_storages():
    from megatron_upipe.planner.simulate import StorageTracker

    before = torch.empty(64)  # made before tracking, then freed and re-allocated in place (Megatron-FSDP's buckets)
    before.untyped_storage().resize_(0)
    shared = torch.empty(10)  # one storage holding two kinds of state
    with StorageTracker(classify=lambda _: "activations") as mem:
        mem.track_split(shared, {"main weights": 16, "grads": 24})
        assert mem.live_by_category["main weights"] == 16 and mem.live_by_category["grads"] == 24
        before.untyped_storage().resize_(256)
        mem.resized(before)  # first seen now, at its new size
        t = torch.zeros(100)  # 400 B
        assert mem.live_bytes == 40 + 256 + 400
        t.untyped_storage().resize_(0)
        mem.resized(t)
        assert mem.live_bytes == 40 + 256
        t.untyped_storage().resize_(200)
        mem.resized(t)
        assert mem.live_bytes == 40 + 256 + 200
        t.untyped_storage().resize_(800)
        mem.resized(t)
        assert mem.live_bytes == mem.peak_bytes == 40 + 256 + 800
        t.untyped_storage().resize_(0)
        mem.resized(t)
        del t  # its storage dies empty: nothing more is subtracted
        assert mem.live_bytes == 40 + 256
        del shared
        assert mem.live_bytes == 256 and mem.live_by_category["grads"] == 0 == mem.live_by_category["main weights"]
    assert mem.peak_bytes == 40 + 256 + 800


def _train_with_plan_check(rank, world_size, metrics):
    from tests.train_harness import SMALL, run_main

    code, err = run_main(*SMALL, *FSDP, "memory.plan_check=true", "train.steps=2", f"log.metrics_file={metrics}")
    assert code == 0, err[-3000:]


def test_training_log_checks_the_plan_of_a_fully_sharded_run(tmp_path):
    """Second step of a real run (Megatron-FSDP in its steady state, Adam's moments alive) vs the planner."""
    from tests.train_harness import read_metrics

    metrics = tmp_path / "metrics.jsonl"
    run_on_ranks(_train_with_plan_check, 2, str(metrics))
    [record] = read_metrics(metrics, kind="memory")
    assert record["step"] == 2 and record["measured_kind"] == "tracked"
    assert abs(record["rel_diff"]) < 0.01, record
