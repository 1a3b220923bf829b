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
    "upipe cp2 x dp2, fsdp, bf16 gradients, optimizer states parked": (
        4, ["parallel.cp=2", "parallel.cp_strategy=upipe", *STACK, *FSDP, "memory.attention_grad_accum=input",
            "memory.fsdp_grads_dtype=bf16", "memory.offload_optimizer_states=true"]),
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
    return out, _plan_both_settings()


def _real_all(rank, world_size):
    from tests.test_planner import measure_real

    return {case: measure_real(_config(case), world_size, VOCAB, bf16=True) for case, (world, _) in CASES.items()
            if world == world_size}


@pytest.fixture(scope="module")
def simulations():
    """The cases' simulated steps, and the two FSDP settings' plans (test_tamed_...): one spawn."""
    return run_on_ranks(_simulate_all, 1)[0]


@pytest.fixture(scope="module")
def simulated(simulations):
    return simulations[0]


@pytest.fixture(scope="module")
def real_runs():
    """Every case's real step, one after another in one world per size (one spawn each)."""
    runs = {}
    for world in sorted({w for w, _ in CASES.values()}):
        runs.update(run_on_ranks(_real_all, world)[0])
    return runs


@pytest.mark.parametrize("case", list(CASES))
def test_simulation_matches_real_run_within_1_percent(simulated, real_runs, case):
    sim, seconds = simulated[case]
    real = real_runs[case]
    err = abs(sim.peak_bytes - real.peak_bytes) / real.peak_bytes
    assert err < 0.01, f"{case}: simulated {sim.peak_bytes} vs real {real.peak_bytes} ({err:.2%}), {seconds:.0f} s"
    assert sim.model_state_bytes == real.model_state_bytes
    assert sum(sim.breakdown.values()) == sim.peak_bytes
    if "parked" in case:  # the moment the parked states are back after the backward: its own peak, also planned
        back = abs(sim.states_back_bytes - real.states_back_bytes) / real.states_back_bytes
        assert back < 0.01, (sim.states_back_bytes, real.states_back_bytes)
        assert real.states_back_bytes - real.breakdown.get("optimizer", 0) > 0
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

    # 512 tokens: the forward/backward's peak above the model states alive between steps, as at real lengths (at 64
    # the tiny model's states, all on the device when the step begins, would be the peak)
    code, err = run_main(*SMALL, *FSDP, "memory.offload_optimizer_states=true", "memory.plan_check=true",
                         "train.steps=2", "train.seq_length=512", f"log.metrics_file={metrics}")
    assert code == 0, err[-3000:]


def test_training_log_checks_the_plan_of_a_fully_sharded_run(tmp_path):
    """Second step of a real run (Megatron-FSDP in its steady state, Adam's moments alive and parked on the host
    during the forward/backward, memory.offload_optimizer_states) vs the planner."""
    from tests.train_harness import read_metrics

    metrics = tmp_path / "metrics.jsonl"
    run_on_ranks(_train_with_plan_check, 2, str(metrics))
    [record] = read_metrics(metrics, kind="memory")
    assert record["step"] == 2 and record["measured_kind"] == "tracked"
    assert abs(record["rel_diff"]) < 0.01, record


TAMED = ["memory.fsdp_communication_unit=layer", "memory.fsdp_embedding_unit=true"]
MEGATRON = ["memory.fsdp_communication_unit=megatron", "memory.fsdp_embedding_unit=false"]


def _losses_job(rank, world_size, tmp):
    from megatron_upipe.memory_switches import sharding
    from tests.train_harness import SMALL, run_main

    wrapped = []
    original = sharding.wrap_fully_sharded

    def spy(*args, **kwargs):  # what reached Megatron-FSDP
        w = original(*args, **kwargs)
        wrapped.append((w.ddp_config.suggested_communication_unit_size, sharding.layer_elements(w),
                        sorted(c.__name__ for c in w.module.fsdp_unit_modules)))
        return w

    sharding.wrap_fully_sharded = spy
    common = [*SMALL, "train.steps=3", "model.num_layers=3"]  # float32 (tiny_cpu.yaml), cp2 UPipe, 4 micro-batches
    runs = {"ddp": run_main(*common, f"log.metrics_file={tmp}/ddp.jsonl"),
            "tamed": run_main(*common, *FSDP, *TAMED, f"log.metrics_file={tmp}/tamed.jsonl"),
            "megatron": run_main(*common, *FSDP, *MEGATRON, f"log.metrics_file={tmp}/megatron.jsonl")}
    return {k: v[0] for k, v in runs.items()}, {k: v[1][-3000:] for k, v in runs.items()}, wrapped


def test_fsdp_settings_reach_megatron_fsdp_and_train_as_ddp(tmp_path):
    from tests.train_harness import read_metrics

    for codes, errs, wrapped in run_on_ranks(_losses_job, 2, str(tmp_path)):
        assert codes == {"ddp": 0, "tamed": 0, "megatron": 0}, errs
        (unit, layer, tamed_units), (default_unit, _, megatron_units) = wrapped
        assert unit == layer - 1 and default_unit is None
        assert tamed_units == ["LanguageModelEmbedding", "TransformerLayer"] and megatron_units == ["TransformerLayer"]
    ddp = read_metrics(tmp_path / "ddp.jsonl")
    assert len(ddp) == 3
    for name in ("tamed", "megatron"):
        for a, b in zip(ddp, read_metrics(tmp_path / f"{name}.jsonl"), strict=True):
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-6), (name, a["step"], a["loss"], b["loss"])
            # megatron-core's float32 norm of the 4096 x 64 embedding / LM head gradients is itself 1.3e-5 from the
            # float64 norm (DDP and FSDP sum in other orders); the gradients themselves: the next test
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=5e-5), (name, a["step"])


def _gradients_job(rank, world_size, overrides):
    """Per-parameter float64 squared norms of one step's reduced gradients (summed over the shards)."""
    import torch.distributed as dist

    from megatron_upipe.models.llama import build_llama, llama_transformer_config
    from megatron_upipe.parallel import destroy_parallel, initialize_parallel
    from megatron_upipe.planner.simulate import _layout, _memory_kwargs
    from megatron_upipe.step import forward_backward
    from megatron_upipe.training.optim import build_optimizer, wrap_model

    vocab = 4096
    config = load_config(None, ["model.preset=tiny", "model.num_layers=3", f"model.vocab_size={vocab}", "data.path=mock",
                                "dist.backend=gloo", "train.micro_batch_size=1", "train.global_batch_size=4",
                                "parallel.cp=2", "parallel.cp_strategy=upipe", "train.seq_length=64",
                                "train.bf16=false", *overrides])
    plan = validate(config, world_size)
    layout = _layout(config, plan)
    pg = initialize_parallel(layout, seed=config.train.seed)
    try:
        tconfig = llama_transformer_config(plan.arch, layout, dtype=torch.float32, init_method_std=0.02)
        stage = build_llama(plan.arch, layout, pg, vocab_size=vocab, config=tconfig,
                            **_memory_kwargs(config, plan, False))
        wrapped = wrap_model(stage.model, tconfig, config)
        optimizer, _ = build_optimizer(wrapped, tconfig, config)
        s, g = plan.seq_per_cp_rank, torch.Generator().manual_seed(1 + rank)
        batches = [{"tokens": torch.randint(0, vocab, (1, s), generator=g), "position_ids": torch.arange(s)[None],
                    "labels": torch.randint(0, vocab, (1, s), generator=g), "loss_mask": torch.ones(1, s)}
                   for _ in range(plan.num_microbatches)]  # [1, s/C] each, this rank's CP part
        forward_backward(wrapped, iter(batches), num_microbatches=plan.num_microbatches, seq_length=plan.seq_length,
                         micro_batch_size=1, forward_only=False)
        if not hasattr(wrapped, "param_and_grad_buffer"):
            return {n: p.main_grad.double().pow(2).sum().item() for n, p in stage.model.named_parameters()}
        out = {}
        for name, p in wrapped.param_and_grad_buffer.optimizer_named_parameters:  # DTensor shards of the buffers
            local = p.grad._local_tensor if p.grad is not None else torch.zeros(0)  # None: no elements here
            sq = local.double().pow(2).sum().reshape(1)
            dist.all_reduce(sq, group=pg.dp_cp)
            out[name.removeprefix("module.")] = sq.item()
        return out
    finally:
        destroy_parallel()


def _gradients_jobs(rank, world_size, runs):
    return [_gradients_job(rank, world_size, overrides) for overrides in runs]


def test_fsdp_settings_give_ddp_gradients():
    """Same weights (the seeded CPU initialisation), same micro-batches: every parameter's reduced gradient has the
    squared norm of DDP's, in float64 (float32 gradients summed in other orders). The three runs share one world."""
    ddp, *sharded = run_on_ranks(_gradients_jobs, 2, [[], [*FSDP, *TAMED], [*FSDP, *MEGATRON]])[0]
    for overrides, fsdp in zip((TAMED, MEGATRON), sharded, strict=True):
        assert set(fsdp) == set(ddp)
        for name, sq in ddp.items():
            assert fsdp[name] == pytest.approx(sq, rel=1e-6), (overrides, name)


def _plan_both_settings():
    """(in _simulate_all's process, after it destroyed the default group)"""
    from megatron_upipe.planner.simulate import simulate_step

    base = [*BASE, "model.num_layers=6", "parallel.cp=2", "parallel.cp_strategy=upipe", *FSDP]
    return {name: simulate_step(load_config(None, base + ov), 2, VOCAB).breakdown
            for name, ov in (("tamed", TAMED), ("megatron", MEGATRON))}


def test_tamed_settings_bound_megatron_fsdp_buffers_in_the_plan(simulations):
    """Six layers: with megatron-core's defaults the whole model is all-gathered at the peak (5e8 elements of
    prefetch); with one layer's unit at most two layers' gradient buckets and two gathered layers besides the LM
    head's group are alive there."""
    plans = simulations[1]
    # bf16 weights, fp32 gradients of one tiny-gqa layer (unsharded, as Megatron-FSDP gathers it), and of the
    # embedding / LM head (256 x 64 each)
    layer = 64 * 96 + 64 * 64 + 64 * 320 + 160 * 64 + 2 * 64
    head = 256 * 64
    tamed, megatron = plans["tamed"], plans["megatron"]
    assert tamed["fsdp: grad buckets"] <= 4 * (2 * layer + head) * 1.05, tamed
    assert tamed["fsdp: gathered params"] <= 2 * (2 * layer + head + 64) * 1.05, tamed
    assert megatron["fsdp: gathered params"] >= 2 * (6 * layer + 2 * head), megatron  # the whole model at once
    assert sum(tamed.values()) < sum(megatron.values())  # the peaks
