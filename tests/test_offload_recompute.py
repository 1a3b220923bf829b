"""Full activation recompute with the checkpointed layer inputs offloaded to host memory (memory_switches).

One 2-rank gloo job, float32, a 4-layer tiny Llama (GQA), one training step per variant, every variant loading the
same HF-named weights and batch:
- dp2: plain, megatron-core full recompute, full recompute + offload;
- cp2 UPipe: plain, full recompute + offload;
- pp2 (1F1B, 2 micro-batches): plain, full recompute + offload;
- dp2 and pp2 also with the copy back prefetched one layer ahead (memory.offload_prefetch);
- dp2 recomputing only the first 2 of the 4 layers (memory.recompute_layers), without and with offload;
- dp2 with the first 2 layer inputs on the disk tier (memory.offload_disk_layers: files in a temporary directory),
  without and with prefetch.
Checked: loss and every parameter gradient bit-identical to the plain run of the same layout (recompute replays the
same ops in the same order; offload is a copy); the offloader's ledger holds exactly num_layers x [s/cp, b, D]
float32 bytes after the forward and nothing after the step; the tracked device memory after the forward is lower by
exactly those bytes, and the device peak of the step by at least num_layers - 1 layer inputs (the backward brings one
back at a time, with DDP's preallocated gradient buffers); prefetching raises the device peak by exactly one layer
input and changes nothing else. The same on fake tensors at a longer sequence (how the
memory planner runs rank 0's model), where the planner's SimulatedHostOffloader matches the real one. Plus a
process-free check that the offloader keeps its host copies out of a device tracker, on real and fake tensors.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from tests.dist_helper import run_on_ranks

VOCAB, BATCH, SEQ, LAYERS = 256, 2, 64, 4
FAKE_SEQ = 8192  # fake tensors: only shapes, so a longer sequence costs nothing
VARIANTS = {  # name -> (layout kwargs, recompute, offload)
    "dp2": (dict(dp=2), False, False),
    "dp2+recompute": (dict(dp=2), True, False),
    "dp2+recompute+offload": (dict(dp=2), True, True),
    "dp2+recompute+offload+prefetch": (dict(dp=2), True, "prefetch"),
    "dp2+recompute 2 of 4": (dict(dp=2), 2, False),  # memory.recompute_layers=2: megatron-core's block method
    "dp2+recompute 2 of 4+offload+prefetch": (dict(dp=2), 2, "prefetch"),
    "dp2+recompute+offload, 2 to disk": (dict(dp=2), True, "disk"),  # memory.offload_disk_layers=2
    "dp2+recompute+offload+prefetch, 2 to disk": (dict(dp=2), True, "disk+prefetch"),
    "cp2-upipe": (dict(cp=2, cp_strategy="upipe"), False, False),
    "cp2-upipe+recompute+offload": (dict(cp=2, cp_strategy="upipe"), True, True),
    "pp2": (dict(pp=2), False, False),  # 1F1B over 2 micro-batches: stage 0 holds both in flight
    "pp2+recompute+offload": (dict(pp=2), True, True),
    "pp2+recompute+offload+prefetch": (dict(pp=2), True, "prefetch"),  # one chain per micro-batch in flight
}
MICRO = {"pp2": 2, "pp2+recompute+offload": 2, "pp2+recompute+offload+prefetch": 2}


DISK = 2  # layer inputs the disk variants write to files


def _offload(off, disk_dir: str):
    from megatron_upipe.memory_switches.offload import HostOffloader

    if isinstance(off, str) and off.startswith("disk"):
        return lambda pp_rank: HostOffloader(prefetch_ahead=off.endswith("prefetch"), disk_dir=disk_dir,
                                             disk_layers=DISK)
    return (lambda pp_rank: HostOffloader(prefetch_ahead=True)) if off == "prefetch" else off


def _job(rank, world_size):
    from megatron_upipe.models.presets import get_preset
    from megatron_upipe.parallel import ParallelLayout
    from tests.llama_harness import random_hf_state_dict
    from tests.memory_switches_harness import portable, run_memory_layout

    arch = get_preset("tiny-gqa").replace(num_layers=LAYERS)
    hf_sd = random_hf_state_dict(arch, VOCAB, seed=0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    with tempfile.TemporaryDirectory() as disk_dir:
        out = {name: portable(run_memory_layout(ParallelLayout(**kw), arch, hf_sd, tokens, recompute=rec,
                                                offload=_offload(off, disk_dir),
                                                num_microbatches=MICRO.get(name, 1)))
               for name, (kw, rec, off) in VARIANTS.items()}
        out["disk dir left"] = os.listdir(disk_dir)
    out["fake"] = _fake_runs(arch)
    return out


def _fake_runs(arch) -> dict:
    """The memory planner's way: the real model code on fake tensors (shapes only), full recompute at FAKE_SEQ
    tokens, without offload, with HostOffloader and with SimulatedHostOffloader, each also prefetching: (host bytes after forward, host
    bytes at the end, tracked device peak, tracked device bytes after forward)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron_upipe.memory_accounting.tracker import PeakMemoryTracker
    from megatron_upipe.memory_switches.offload import HostOffloader, SimulatedHostOffloader
    from megatron_upipe.models.llama import build_llama, llama_transformer_config
    from megatron_upipe.parallel import ParallelLayout, destroy_parallel, initialize_parallel

    layout = ParallelLayout(dp=2, cp_strategy="upipe")  # cp=1: UPipe's head stages, no collectives in the step
    pg = initialize_parallel(layout)
    out = {}
    try:
        for name, make in (("none", None), ("host", HostOffloader), ("simulated", SimulatedHostOffloader),
                           ("host+prefetch", lambda: HostOffloader(prefetch_ahead=True)),
                           ("simulated+prefetch", lambda: SimulatedHostOffloader(prefetch_ahead=True))):
            with FakeTensorMode(allow_non_fake_inputs=True):
                config = llama_transformer_config(arch, layout, recompute_granularity="full")
                stage = build_llama(arch, layout, pg, vocab_size=VOCAB, config=config,
                                    offloader=make() if make else None)
                model, off = stage.model, stage.offloader
                tokens = torch.randint(0, VOCAB, (1, FAKE_SEQ))
                with PeakMemoryTracker() as mem:
                    loss = model(tokens, torch.arange(FAKE_SEQ)[None], None, labels=tokens).float().mean()
                    host, device = (off.live_bytes if off else 0), mem.live_bytes
                    loss.backward()
                out[name] = (host, off.live_bytes if off else 0, mem.peak_bytes, device)
    finally:
        destroy_parallel()
    return out


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(_job, 2)


def _layer_input_bytes(layout_kw) -> int:
    from megatron_upipe.models.presets import get_preset

    dp, cp = layout_kw.get("dp", 1), layout_kw.get("cp", 1)
    return SEQ // cp * (BATCH // dp) * get_preset("tiny-gqa").hidden_size * 4  # [s/cp, b, D] float32


def test_losses_and_gradients_bit_identical(results):
    from tests.llama_harness import rel_err

    for per_rank in results:
        for plain, others in (("dp2", ["dp2+recompute", "dp2+recompute+offload", "dp2+recompute+offload+prefetch",
                                       "dp2+recompute 2 of 4", "dp2+recompute 2 of 4+offload+prefetch",
                                       "dp2+recompute+offload, 2 to disk",
                                       "dp2+recompute+offload+prefetch, 2 to disk"]),
                              ("cp2-upipe", ["cp2-upipe+recompute+offload"]),
                              ("pp2", ["pp2+recompute+offload", "pp2+recompute+offload+prefetch"])):
            ref = per_rank[plain]
            assert len(ref.grads) == 2 + 9 * LAYERS + 1  # embed, lm_head, final norm; 9 tensors per layer
            for name in others:
                r = per_rank[name]
                assert r.losses == ref.losses, (name, r.losses, ref.losses)
                assert r.grads.keys() == ref.grads.keys()
                errs = {k: rel_err(torch.from_numpy(r.grads[k]), torch.from_numpy(g)) for k, g in ref.grads.items()}
                assert max(errs.values()) <= 1e-5, (name, {k: e for k, e in errs.items() if e > 1e-5})
                assert all((r.grads[k] == g).all() for k, g in ref.grads.items()), f"{name}: not bit-exact"
    # the layouts compute the same model (UPipe's attention vs plain, pipeline stages): losses agree to rounding
    for name in ("cp2-upipe", "pp2"):
        assert results[0][name].losses == pytest.approx(results[0]["dp2"].losses, rel=1e-5)


def test_host_ledger_holds_exactly_the_layer_inputs(results):
    for per_rank in results:
        for name, (kw, rec, off) in VARIANTS.items():
            r = per_rank[name]
            layers = LAYERS if rec is True else rec  # only the recomputed layers' inputs are offloaded
            if isinstance(off, str) and off.startswith("disk"):  # the first DISK of them go to files instead
                layers -= DISK
            expected = layers * _layer_input_bytes(kw) if off else 0
            if name.startswith("pp2+"):  # L/2 layers per stage; the first forward of mb=1 of 2 rows
                expected = LAYERS // 2 * _layer_input_bytes(dict(dp=2))
            assert r.host_after_forward == expected, (name, r.host_after_forward, expected)
            if name.startswith("pp2+"):  # 1F1B: stage 0 runs 2 forwards before its first backward
                assert r.host_peak == expected * (2 if per_rank is results[0] else 1), (name, r.host_peak)
            else:
                assert r.host_peak == expected, name
            assert r.host_end == 0, f"{name}: host copies alive after the step"


def test_device_memory_drops_by_the_offloaded_inputs(results):
    for per_rank in results:
        for rec, off in (("dp2+recompute", "dp2+recompute+offload"),):
            one = _layer_input_bytes(VARIANTS[off][0])
            a, b = per_rank[rec], per_rank[off]
            assert a.device_after_forward - b.device_after_forward == LAYERS * one
            drop = a.device_peak[0] - b.device_peak[0]
            assert (LAYERS - 1) * one <= drop <= LAYERS * one, (drop, one)
        # prefetch: the previous layer's input comes back while a layer's backward runs, one at a time
        one = _layer_input_bytes(VARIANTS["dp2+recompute+offload"][0])
        off, pre = per_rank["dp2+recompute+offload"], per_rank["dp2+recompute+offload+prefetch"]
        assert pre.device_after_forward == off.device_after_forward
        assert pre.device_peak[0] - off.device_peak[0] == one, (pre.device_peak, off.device_peak, one)
        # recomputing 2 of 4 layers: the device peak between none and all, its host copies 2 inputs
        part = per_rank["dp2+recompute 2 of 4"].device_peak[0]
        assert per_rank["dp2+recompute"].device_peak[0] < part < per_rank["dp2"].device_peak[0]
        # recompute itself lowers the peak (sanity of the measurement)
        assert per_rank["dp2+recompute"].device_peak[0] < per_rank["dp2"].device_peak[0]
        assert per_rank["cp2-upipe+recompute+offload"].device_peak[0] < per_rank["cp2-upipe"].device_peak[0]


def test_disk_tier_holds_the_first_layers_and_the_device_sees_no_difference(results):
    """The first DISK layer inputs of the forward go to files (written once, read once, freed at the end, no file
    left behind); the device holds exactly what the host-only offload holds, with and without prefetch."""
    one = _layer_input_bytes(dict(dp=2))
    for per_rank in results:
        assert per_rank["disk dir left"] == []
        for disk, host in (("dp2+recompute+offload, 2 to disk", "dp2+recompute+offload"),
                           ("dp2+recompute+offload+prefetch, 2 to disk", "dp2+recompute+offload+prefetch")):
            d, h = per_rank[disk], per_rank[host]
            assert d.disk == (DISK * one, 0, DISK * one, DISK * one), (disk, d.disk)
            assert h.disk == (0, 0, 0, 0)
            assert d.device_peak == h.device_peak and d.device_after_forward == h.device_after_forward, disk
            assert h.host_peak - d.host_peak == DISK * one


def test_on_fake_tensors_the_ledger_and_device_peak_are_the_same(results):
    one = FAKE_SEQ * 64 * 4  # [s, b=1, D] float32
    for per_rank in results:
        fake = per_rank["fake"]
        assert fake["host"][:2] == (LAYERS * one, 0) and fake["simulated"][:2] == (LAYERS * one, 0)
        assert fake["host"][2:] == fake["simulated"][2:]  # the simulation sees the device memory the real one does
        assert fake["host+prefetch"] == fake["simulated+prefetch"]
        assert fake["host+prefetch"][3] == fake["host"][3]  # the forward is the same; backward holds one more input
        # (the .grad tensors growing here too: the peak may move to another layer, by at most one input)
        assert 0 < fake["host+prefetch"][2] - fake["host"][2] <= one, (fake["host+prefetch"], fake["host"])
        assert fake["none"][3] - fake["host"][3] == LAYERS * one
        # Without DDP's preallocated buffers the .grad tensors grow during backward, so the peak may sit at the
        # last layer's backward, where both runs hold one input: only 0 < drop <= L inputs is guaranteed here.
        assert 0 < fake["none"][2] - fake["host"][2] <= LAYERS * one, fake


def test_offloader_hides_host_copies_from_device_tracker_also_on_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron_upipe.memory_accounting.tracker import PeakMemoryTracker
    from megatron_upipe.memory_switches.offload import HostOffloader, SimulatedHostOffloader, pinned_block_bytes

    nbytes = 16 * 4 * 8 * 4
    for fake in (False, True):
        for cls in (HostOffloader, SimulatedHostOffloader):
            off = cls()
            with (FakeTensorMode() if fake else torch.device("cpu")), PeakMemoryTracker() as mem:
                x = torch.randn(16, 4, 8)
                y = x * 2
                copy = off.to_host(y)
                assert off.live_bytes == nbytes and mem.live_bytes == 2 * nbytes  # the host copy is not counted
                del y
                assert mem.live_bytes == nbytes
                z = off.to_device(copy)
                assert mem.live_bytes == 2 * nbytes and z.shape == (16, 4, 8) and z.dtype == torch.float32
                if cls is HostOffloader and not fake:
                    assert torch.equal(z, x * 2)
                del copy
                assert off.live_bytes == 0 and off.peak_bytes == nbytes == off.reserved_peak_bytes  # pageable: exact
    assert [pinned_block_bytes(n) for n in (1, 4096, 4097, 6 * 2**30)] == [1, 4096, 8192, 8 * 2**30]


def test_config_switches():
    from megatron_upipe.config import load_config, validate
    from tests.test_config import TINY

    no_ckpt = ["checkpoint.dir=null", "checkpoint.interval=0"]
    plan = validate(load_config(TINY, ["memory.recompute=full", "memory.offload_checkpoints=true",
                                       "memory.shard_model_states=true", *no_ckpt]), 2)
    assert plan.warnings == ()
    one = validate(load_config(TINY, ["parallel.cp=1", "memory.shard_model_states=true", *no_ckpt]), 1)
    assert any("nothing to shard" in w for w in one.warnings)
