"""Host memory as a budget: the offloader's one host pool per rank, its plan, and the start-up check.

- The range allocator (first fit, aligned ranges, merged on release, refuses what it did not hand out) and the pool
  on this CPU machine: one buffer of exactly the asked bytes, pageable with one logged line (pinning needs CUDA),
  copies are slices of it, ranges are reused, a copy that finds no room goes beside the pool (logged once). Its
  CUDA-only pinning against a stand-in cudart: cudaHostRegister of exactly its range, unregistered when it goes.
- One 2-rank gloo job, float32, a 4-layer tiny Llama, 3 training steps each: full recompute + offload without a pool
  (one host copy per tensor, the reference) and with the pool sized by host_budget.offload_pool_bytes from the
  config, for dp2 and for pp2 (1F1B, 2 micro-batches: stage 0 holds both in flight). Losses of every step and the
  first step's gradients are bit-identical; the pool equals the unpooled run's host peak to the byte (the plan is
  exact), holds every copy (no misses), and holds the same bytes after every step (it never grows). On fake tensors
  (the planner's way), the planner's SimulatedHostOffloader reserves exactly what the real pooled offloader does.
- The planner: simulate_step's host bytes are the planned pool; estimate() reports host bytes per rank and per node
  and a plan fits only if the host fits too. The 6M recipe's numbers, computed by hand here.
- The trainer refuses, in one line naming memory.host_mem_gib and memory.offload_checkpoints, before it builds the
  model, a plan whose host memory exceeds memory.host_mem_gib; with room it trains with the pool, which the plan
  sized exactly.
"""

from __future__ import annotations

import logging

import pytest
import torch

from megatron_upipe.config import load_config, validate
from tests.dist_helper import run_on_ranks

GIB = 1 << 30
VOCAB, BATCH, SEQ, LAYERS, STEPS = 256, 2, 64, 4, 3
FAKE_SEQ = 8192
LAYOUTS = {"dp2": (dict(dp=2), 1), "pp2": (dict(pp=2), 2)}  # name -> (layout kwargs, micro-batches)


# --- the range allocator and the pool (no processes) ---------------------------------------------------------------
def test_range_allocator_first_fit_aligned_merged():
    from megatron_upipe.memory_switches.pinned_pool import ALIGN, RangeAllocator, aligned

    assert [aligned(n) for n in (0, 1, ALIGN, ALIGN + 1)] == [0, ALIGN, ALIGN, 2 * ALIGN]
    a = RangeAllocator(4 * ALIGN)
    offs = [a.take(ALIGN) for _ in range(4)]
    assert offs == [0, ALIGN, 2 * ALIGN, 3 * ALIGN] and a.take(1) is None and a.used_bytes == 4 * ALIGN
    a.give(ALIGN, ALIGN)
    a.give(2 * ALIGN, 100)  # 100 bytes took one aligned range
    assert a.free_ranges == [(ALIGN, 2 * ALIGN)]  # merged
    assert a.take(2 * ALIGN) == ALIGN  # the merged range serves a larger request
    a.give(0, ALIGN)
    a.give(3 * ALIGN, ALIGN)
    a.give(ALIGN, 2 * ALIGN)
    assert a.free_ranges == [(0, 4 * ALIGN)] and a.used_bytes == 0 and a.peak_used_bytes == 4 * ALIGN
    with pytest.raises(RuntimeError, match="was not taken"):
        a.give(0, ALIGN)  # already free
    with pytest.raises(RuntimeError, match="was not taken"):
        a.give(4 * ALIGN, ALIGN)  # outside


def test_pool_is_one_exact_buffer_sliced_and_reused_pageable_here(caplog):
    from megatron_upipe.memory_switches.offload import HostOffloader

    nbytes = 3 * 4096 + 512  # not a power of two: torch's pinned allocator would take 16384
    with caplog.at_level(logging.WARNING):
        off = HostOffloader(pool_bytes=nbytes)
    pool = off.pool
    assert pool.buffer.untyped_storage().nbytes() == nbytes and off.reserved_peak_bytes == nbytes
    lines = [r.getMessage() for r in caplog.records if "pageable" in r.getMessage()]
    assert not torch.cuda.is_available() and len(lines) == 1 and "no CUDA device" in lines[0], lines
    assert not pool.pinned

    xs = [torch.randn(16, 2, 32), torch.randn(8, 64, dtype=torch.float64).t(), torch.randn(7, dtype=torch.float32)]
    copies = [off.to_host(x) for x in xs]  # 4096 + 4096 + 28 (-> 512) bytes
    base = pool.buffer.data_ptr()
    for c, x in zip(copies, xs):
        assert c.host.untyped_storage().data_ptr() == base  # a slice of the pool, not its own allocation
        assert torch.equal(off.to_device(c), x) and off.to_device(c).data_ptr() != c.host.data_ptr()
    del c
    assert [c.slot.offset for c in copies] == [0, 4096, 8192]
    assert off.live_bytes == sum(x.numel() * x.element_size() for x in xs) == 8220
    assert off.ledger.reserved_bytes == nbytes  # the pool, nothing beside it
    del copies[1]  # the middle range is free again: the next tensor of its size takes it
    again = off.to_host(torch.ones(1024))
    assert again.slot.offset == 4096 and torch.equal(off.to_device(again), torch.ones(1024))

    with caplog.at_level(logging.WARNING):
        big = [off.to_host(torch.full((2048,), 2.0)) for _ in range(2)]  # 8 KiB each, 4 KiB free: both miss
    assert all(b.slot is None and b.host.untyped_storage().data_ptr() != base for b in big)
    assert all(torch.equal(off.to_device(b), torch.full((2048,), 2.0)) for b in big)
    assert off.ledger.pool_misses == 2 and sum("has no room" in r.getMessage() for r in caplog.records) == 1
    assert off.ledger.reserved_bytes == nbytes + 2 * 8192  # pageable copies beside the pool, counted as such
    del big, copies, again
    assert off.live_bytes == 0 and off.ledger.reserved_bytes == nbytes and pool.allocator.used_bytes == 0
    assert off.pool.buffer.data_ptr() == base  # the same buffer throughout


def test_pool_pins_its_exact_range_with_cuda_host_register(monkeypatch, caplog):
    """The CUDA-only lines against a stand-in cudart (no GPU here): cudaHostRegister(ptr, nbytes, 0) of the pool's
    own buffer, cudaHostUnregister of the same pointer when the pool goes; a failed register leaves it pageable,
    said in one line."""
    import gc

    from megatron_upipe.memory_switches import pinned_pool

    calls = []

    class Cudart:
        def __init__(self, code):
            self.code = code

        def cudaHostRegister(self, ptr, nbytes, flags):
            calls.append(("register", ptr, nbytes, flags))
            return self.code

        def cudaHostUnregister(self, ptr):
            calls.append(("unregister", ptr))
            return 0

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(pinned_pool, "_drain_cuda_error", lambda: calls.append(("drain",)))
    monkeypatch.setattr(torch.cuda, "cudart", lambda: Cudart(0))
    pool = pinned_pool.HostPool(12800)
    ptr = pool.buffer.data_ptr()
    assert pool.pinned and calls == [("register", ptr, 12800, 0)]
    del pool
    gc.collect()
    assert calls[1:] == [("unregister", ptr)]
    calls.clear()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: Cudart(2))  # cudaErrorMemoryAllocation
    with caplog.at_level(logging.WARNING):
        pool = pinned_pool.HostPool(12800)
    assert not pool.pinned and calls[1:] == [("drain",)]
    lines = [r.getMessage() for r in caplog.records if "pageable" in r.getMessage()]
    assert len(lines) == 1 and "cudaHostRegister failed (cudaError 2" in lines[0], lines


def test_simulated_pool_keeps_the_same_books():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron_upipe.memory_switches.offload import HostOffloader, SimulatedHostOffloader

    books = []
    for cls in (HostOffloader, SimulatedHostOffloader):
        off = cls(pool_bytes=3 * 4096)
        with FakeTensorMode():
            held = [off.to_host(torch.empty(1024)) for _ in range(3)]
            del held[0]
            held.append(off.to_host(torch.empty(1024)))
            held.append(off.to_host(torch.empty(1024)))  # no room: beside the pool
            books.append(([h.slot and h.slot.offset for h in held], off.peak_bytes, off.reserved_peak_bytes,
                          off.ledger.pool_misses))
    assert books[0] == books[1] == ([4096, 8192, 0, None], 4 * 4096, 4 * 4096, 1)


# --- the trained model: pooled vs unpooled, and the plan ------------------------------------------------------------
def _config(layout: str, seq: int = SEQ, extra=()):
    kw, micro = LAYOUTS[layout]
    return load_config(None, [
        "model.preset=tiny-gqa", f"model.num_layers={LAYERS}", f"model.vocab_size={VOCAB}", "data.path=mock",
        "train.bf16=false", f"train.seq_length={seq}", f"train.global_batch_size={BATCH}",
        f"train.micro_batch_size={BATCH // kw.get('dp', 1) // micro}", f"parallel.pp={kw.get('pp', 1)}",
        "memory.recompute=full", "memory.offload_checkpoints=true", *extra])


def _job(rank, world_size):
    from megatron_upipe.memory_switches.host_budget import offload_pool_bytes
    from megatron_upipe.memory_switches.offload import HostOffloader
    from megatron_upipe.models.presets import get_preset
    from megatron_upipe.parallel import ParallelLayout
    from tests.llama_harness import random_hf_state_dict
    from tests.memory_switches_harness import portable, run_memory_layout

    arch = get_preset("tiny-gqa").replace(num_layers=LAYERS)
    hf_sd = random_hf_state_dict(arch, VOCAB, seed=0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    out = {}
    for name, (kw, micro) in LAYOUTS.items():
        config = _config(name)
        plan = validate(config, world_size)
        pools = []

        def pooled(pp_rank):
            pools.append(offload_pool_bytes(config, plan, 4, pp_rank))
            return HostOffloader(pool_bytes=pools[-1])

        for variant, offload in (("unpooled", True), ("pooled", pooled)):
            out[name, variant] = portable(run_memory_layout(
                ParallelLayout(**kw), arch, hf_sd, tokens, steps=STEPS, recompute=True, offload=offload,
                num_microbatches=micro))
        out[name, "pool"] = pools[0]
    out["fake"] = _fake_books(arch)
    return out


def _fake_books(arch) -> dict:
    """Rank 0's model on fake tensors at FAKE_SEQ (as the planner runs it), one forward/backward, with the real
    pooled offloader and the planner's simulated one: (reserved peak, peak, misses)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron_upipe.memory_switches.host_budget import offload_pool_bytes
    from megatron_upipe.memory_switches.offload import HostOffloader, SimulatedHostOffloader
    from megatron_upipe.models.llama import build_llama, llama_transformer_config
    from megatron_upipe.parallel import ParallelLayout, destroy_parallel, initialize_parallel

    layout = ParallelLayout(dp=2, cp_strategy="upipe")  # cp=1: UPipe's head stages, no collectives in the step
    config = load_config(None, ["model.preset=tiny-gqa", f"model.num_layers={LAYERS}", f"model.vocab_size={VOCAB}",
                                "data.path=mock", f"train.seq_length={FAKE_SEQ}", "train.global_batch_size=2",
                                "memory.recompute=full", "memory.offload_checkpoints=true"])
    pool = offload_pool_bytes(config, validate(config, 2), 4)
    pg = initialize_parallel(layout)
    out = {"pool": pool}
    try:
        for name, cls in (("host", HostOffloader), ("simulated", SimulatedHostOffloader)):
            off = cls(pool_bytes=pool)
            with FakeTensorMode(allow_non_fake_inputs=True):
                tconfig = llama_transformer_config(arch, layout, recompute_granularity="full")
                model = build_llama(arch, layout, pg, vocab_size=VOCAB, config=tconfig, offloader=off).model
                tokens = torch.randint(0, VOCAB, (1, FAKE_SEQ))
                model(tokens, torch.arange(FAKE_SEQ)[None], None, labels=tokens).float().mean().backward()
            out[name] = (off.reserved_peak_bytes, off.peak_bytes, off.ledger.pool_misses, off.live_bytes)
    finally:
        destroy_parallel()
    return out


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(_job, 2)


def test_pooled_offload_is_bit_exact(results):
    for per_rank in results:
        for name in LAYOUTS:
            ref, got = per_rank[name, "unpooled"], per_rank[name, "pooled"]
            assert len(got.losses) == STEPS and got.losses == ref.losses, (name, got.losses, ref.losses)
            assert got.grads.keys() == ref.grads.keys()
            assert all((got.grads[k] == g).all() for k, g in ref.grads.items()), f"{name}: gradients not bit-exact"


def test_pool_is_the_planned_bytes_exactly_and_never_grows(results):
    one = SEQ * (BATCH // 2) * 64 * 4  # [s, b, D] float32 layer input (dp2: b = 1; pp2: 2 micro-batches of 1)
    for rank, per_rank in enumerate(results):
        for name in LAYOUTS:
            ref, got, pool = per_rank[name, "unpooled"], per_rank[name, "pooled"], per_rank[name, "pool"]
            assert pool == ref.host_peak, (name, pool, ref.host_peak)  # the plan is the measured peak, to the byte
            expected = LAYERS * one if name == "dp2" else LAYERS // 2 * one * (2 if rank == 0 else 1)
            assert pool == expected, (name, rank, pool, expected)
            assert got.host_peak == ref.host_peak and got.pool_misses == 0 and got.host_end == 0
            assert got.host_reserved == (pool,) * STEPS, (name, got.host_reserved)  # the same bytes, every step
            assert ref.host_reserved == (0,) * STEPS  # the reference frees its copies (no pool)


def test_planner_simulation_accounts_the_pool_as_allocated(results):
    for per_rank in results:
        fake = per_rank["fake"]
        one = FAKE_SEQ * 64 * 4
        assert fake["pool"] == LAYERS * one
        assert fake["host"] == fake["simulated"] == (LAYERS * one, LAYERS * one, 0, 0), fake


# --- the planner --------------------------------------------------------------------------------------------------
def _simulate(rank, world_size):
    from megatron_upipe.planner.estimate import ConfigSource, estimate
    from megatron_upipe.planner.simulate import simulate_step

    torch.distributed.destroy_process_group()  # the planner makes its own fake one
    step = simulate_step(_config("pp2"), 2, VOCAB)
    over = ("model.preset=tiny-gqa", f"model.num_layers={LAYERS}", f"model.vocab_size={VOCAB}", "data.path=mock",
            "train.bf16=false", "train.seq_length=4096", "train.global_batch_size=2", "train.micro_batch_size=1",
            "memory.recompute=full", "memory.offload_checkpoints=true", "checkpoint.dir=/tmp/unused",
            "memory.host_mem_gib=2")
    return step, estimate(ConfigSource(None, over), 2, VOCAB, "none", 4096, 80 * GIB)


def test_planner_reports_host_per_rank_and_node_and_fits_only_if_host_fits():
    from megatron_upipe.memory_switches.host_budget import HostMargins, checkpoint_staging_bytes, offload_pool_bytes

    step, est = run_on_ranks(_simulate, 1)[0]
    cfg = _config("pp2")
    assert step.host_peak_bytes == offload_pool_bytes(cfg, validate(cfg, 2), 4) == LAYERS // 2 * 2 * SEQ * 64 * 4
    # 'none': cp=1, the 2 ranks are dp; 4 layers x [4096, 1, 64] float32 per rank
    pool = LAYERS * 4096 * 64 * 4
    cfg = load_config(None, ["model.preset=tiny-gqa", f"model.num_layers={LAYERS}", "data.path=mock",
                             "train.bf16=false", "train.seq_length=4096", "train.global_batch_size=2",
                             "checkpoint.dir=/tmp/unused", f"model.vocab_size={VOCAB}"])
    staging = checkpoint_staging_bytes(cfg, validate(cfg, 2), VOCAB, 4)
    # dist_checkpointing stages each weight and its two Adam moments (float32, no main copy) in pinned blocks of a
    # power of two: per layer qkv 6144 el. (24 KiB -> 32), proj 4096 (16 KiB), fc1 20480 (80 -> 128 KiB),
    # fc2 10240 (40 -> 64 KiB), two norms of 64 (256 B); embedding and output 256 x 64 (64 KiB), final norm 256 B
    layer = 32768 + 16384 + 131072 + 65536 + 256 + 256
    assert staging == 3 * (LAYERS * layer + 65536 + 65536 + 256) == 3349248
    margin = HostMargins().process_cuda_bytes  # the planner plans for GPUs
    assert est.host_breakdown == {"offload pool": pool, "checkpoint staging": staging, "margin: process": margin}
    assert est.host_bytes == pool + staging + margin
    assert est.host_bytes_per_node == 2 * est.host_bytes + HostMargins().os_bytes(2 * GIB)  # 2 ranks on a node
    assert est.host_mem_bytes == 2 * GIB and est.host_bytes_per_node > 2 * GIB  # 2 x 6 GiB process margins alone
    assert est.peak_bytes < est.gpu_mem_bytes and not est.host_fits and not est.fits  # device fits, host does not


def test_host_plan_of_the_6m_recipe():
    from megatron_upipe.memory_switches.host_budget import GIB as G
    from megatron_upipe.memory_switches.host_budget import plan_host_memory

    path = "examples/configs/llama3_8b_upipe_8xh100_6m.yaml"
    config = load_config(path, [])
    plan = validate(config, 8)
    host = plan_host_memory(config, plan, 128256, bf16=True, cuda=True, ranks_per_node=8, host_mem_bytes=2048 * G)
    assert host.offload_pool_bytes == 32 * 786432 * 4096 * 2 == 192 * G  # 32 layers x [786432, 1, 4096] bf16
    params = plan.arch.num_parameters(128256)  # 128256 is already a multiple of 128: no padded rows
    assert host.checkpoint_staging_bytes == -(-params // 8) * (2 + 4 + 8)  # fsdp_per_rank: bf16, fp32 main, 2 moments
    assert 13 * G < host.checkpoint_staging_bytes < 14 * G
    assert host.fits and 1.6 * 1024 * G < host.per_node_bytes < 1.8 * 1024 * G
    tight = plan_host_memory(load_config(path, ["memory.host_mem_gib=1024"]), plan, 128256, bf16=True, cuda=True,
                             ranks_per_node=8)
    assert not tight.fits
    line = tight.refusal()
    assert "\n" not in line and "memory.host_mem_gib=1024" in line and "memory.offload_checkpoints=false" in line


# --- the trainer's start-up check --------------------------------------------------------------------------------
def _train_job(rank, world_size, tmp):
    import megatron_upipe.training.build as build
    from tests.train_harness import SMALL, run_main

    built, offloaders = [], []
    real_build, real_switches = build.build_llama, build.memory_switches

    def spy_build(*args, **kwargs):
        built.append(1)
        return real_build(*args, **kwargs)

    def spy_switches(*args, **kwargs):
        out = real_switches(*args, **kwargs)
        offloaders.append(out["offloader"])
        return out

    build.build_llama, build.memory_switches = spy_build, spy_switches
    memory = ["memory.recompute=full", "memory.offload_checkpoints=true"]
    code, err = run_main(*SMALL, *memory, "memory.host_mem_gib=0.5", "train.steps=2",
                         f"log.metrics_file={tmp}/refused.jsonl")
    refused = (code, err, len(built))
    code, err = run_main(*SMALL, *memory, "train.steps=2", f"log.metrics_file={tmp}/ok.jsonl")
    off = offloaders[0]
    return refused, (code, err, len(built), len(offloaders), type(off).__name__, off.pool_bytes, off.peak_bytes, off.reserved_peak_bytes,
                     off.ledger.pool_misses, off.ledger.total_copies)


def test_trainer_refuses_before_building_and_trains_with_the_planned_pool(tmp_path):
    for rank, (refused, ran) in enumerate(run_on_ranks(_train_job, 2, str(tmp_path))):
        code, err, built = refused
        lines = [ln for ln in err.splitlines() if "host memory" in ln]
        assert code == 2 and built == 0, (code, err)
        assert len(lines) == 1 and "memory.host_mem_gib=0.5" in lines[0] and \
            "memory.offload_checkpoints=false" in lines[0], err
        code, err, built, made, kind, pool, peak, reserved, misses, copies = ran
        assert code == 0 and built == 1 and made == 1 and kind == "HostOffloader", err
        # tiny_cpu: 2 layers, cp2 -> [32, 1, 64] float32 inputs per rank, one micro-batch in flight
        assert pool == peak == reserved == 2 * 32 * 64 * 4 and misses == 0
        assert copies == 2 * 4 * 2  # 2 steps x 4 micro-batches x 2 layers
