"""The offloader's disk tier (memory.offload_disk_layers / offload_disk_dir): files, the plan, the check, the price.

- disk_file.DiskFile: a tensor's bytes round-trip bit for bit (bf16, float32, int64), also in several pieces; the
  file is unlinked from the start (the directory stays empty) and a wrong-sized read is refused.
- HostOffloader: a disk copy takes no host bytes, counts its bytes on disk (alive, peak, written, read) and frees
  them when dropped; to_device and prefetch give the tensor back bit for bit. On fake tensors (planning) nothing
  is written, the books are the same.
- The config refuses a disk tier without offload, without a directory, with pp > 1 or with more layers than are
  offloaded, in one line each; the host plan's pool shrinks by exactly the layers on disk; the start-up check
  refuses a missing directory and one with less free space than the node's ranks keep there.
- The step-time model puts the writes and reads on the critical path at the stated disk bandwidth.
The training step with layer inputs on disk (bit-identical, same device memory) is in tests/test_offload_recompute.py.
"""

from __future__ import annotations

import os

import pytest
import torch

from megatron_upipe.config import ConfigError, load_config, validate

RECIPE = "examples/configs/llama3_8b_upipe_8xh100_6m.yaml"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int64])
def test_disk_file_round_trip_in_pieces(tmp_path, monkeypatch, dtype):
    import megatron_upipe.memory_switches.disk_file as disk_file

    monkeypatch.setattr(disk_file, "PIECE", 1000)  # several pieces per tensor
    t = (torch.randn(37, 3, 41) * 100).to(dtype)
    f = disk_file.DiskFile(str(tmp_path))
    assert os.listdir(tmp_path) == []  # unlinked at once
    f.write(t)
    back = torch.empty_like(t)
    f.read_into(back)
    assert torch.equal(back, t) and f.nbytes == t.numel() * t.element_size()
    with pytest.raises(ValueError):
        f.read_into(torch.empty(3, dtype=dtype))
    f.close()


def test_offloader_disk_copies_books_and_bits(tmp_path):
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron_upipe.memory_accounting.tracker import PeakMemoryTracker
    from megatron_upipe.memory_switches.offload import HostOffloader, SimulatedHostOffloader

    x = torch.randn(64, 2, 16).to(torch.bfloat16)
    nbytes = x.numel() * 2
    off = HostOffloader(pool_bytes=4 * nbytes, disk_dir=str(tmp_path), disk_layers=1)
    near, far = off.to_host(x), off.to_host(x * 2, disk=True)
    assert off.live_bytes == nbytes and off.ledger.disk_live_bytes == nbytes  # the disk copy takes no host bytes
    with PeakMemoryTracker() as mem:
        back = off.to_device(far)
        assert mem.live_bytes == nbytes  # the copy back is a device tensor like any other
    assert torch.equal(back, x * 2) and torch.equal(off.to_device(near), x)
    off.prefetch(far)
    assert torch.equal(off.to_device(far), x * 2)
    led = off.ledger
    assert (led.disk_written_bytes, led.disk_read_bytes, led.returned_bytes) == (nbytes, 2 * nbytes, 3 * nbytes)
    del far
    assert led.disk_live_bytes == 0 and led.disk_peak_bytes == nbytes and os.listdir(tmp_path) == []
    for cls in (HostOffloader, SimulatedHostOffloader):  # planning: shapes only, the same books
        sim = cls(pool_bytes=4 * nbytes, disk_dir="/nonexistent", disk_layers=1)
        with FakeTensorMode():
            copy = sim.to_host(torch.randn(64, 2, 16, dtype=torch.bfloat16), disk=True)
            assert sim.to_device(copy).shape == (64, 2, 16)
        assert (sim.ledger.disk_peak_bytes, sim.ledger.disk_read_bytes, sim.live_bytes) == (nbytes, nbytes, 0)
    with pytest.raises(ValueError, match="disk_dir"):
        HostOffloader(disk_layers=2)


@pytest.mark.parametrize("extra, words", [
    (["memory.offload_checkpoints=false", "memory.offload_prefetch=false", "memory.offload_disk_dir=/raid"],
     "memory.offload_checkpoints=false"),
    (["memory.offload_disk_dir=null"], "needs memory.offload_disk_dir"),
    (["memory.offload_disk_dir=/raid", "parallel.pp=2", "parallel.cp=4", "memory.shard_model_states=false"],
     "parallel.pp=2"),
    (["memory.offload_disk_dir=/raid", "memory.recompute_layers=2"], "exceeds the 2 layer inputs"),
])
def test_config_refuses_in_one_line(extra, words):
    with pytest.raises(ConfigError) as e:
        validate(load_config(RECIPE, ["memory.offload_disk_layers=4", *extra]), 8)
    assert "\n" not in str(e.value) and words in str(e.value), str(e.value)


def test_host_plan_shrinks_by_the_layers_on_disk_and_the_start_up_check(tmp_path, monkeypatch):
    import shutil

    from megatron_upipe.memory_switches import host_budget as hb

    on_disk = ["memory.offload_disk_layers=4", f"memory.offload_disk_dir={tmp_path}"]
    plain, disk = load_config(RECIPE, []), load_config(RECIPE, on_disk)
    plan = validate(disk, 8)
    one = plan.seq_per_cp_rank * 4096 * 2  # [s/cp, b=1, D] bf16
    assert hb.offload_pool_bytes(plain, plan, 2) - hb.offload_pool_bytes(disk, plan, 2) == 4 * one
    assert hb.disk_bytes(disk, plan, 2) == 4 * one and hb.disk_bytes(plain, plan, 2) == 0
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**15, 0, 32 * one))
    assert hb.disk_refusal(disk, plan, bf16=True, world_size=8) is None  # 8 ranks x 4 inputs: exactly room
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**15, 0, 32 * one - 1))
    line = hb.disk_refusal(disk, plan, bf16=True, world_size=8)
    assert "\n" not in line and "memory.offload_disk_layers=4" in line and "free" in line
    missing = load_config(RECIPE, ["memory.offload_disk_layers=4", f"memory.offload_disk_dir={tmp_path}/none"])
    assert "is not a writable directory" in hb.disk_refusal(missing, plan, bf16=True, world_size=8)
    assert hb.disk_refusal(plain, plan, bf16=True, world_size=8) is None


def test_step_time_prices_the_disk_on_the_critical_path():
    from megatron_upipe.planner.step_time import HARDWARE, predict

    hw = HARDWARE["h100-80gb"]
    w = {"flops:gemm": 10**15, "bytes:disk_write": 6 * 10**9, "bytes:disk_read": 3 * 10**9}
    t = predict(w, hw, 1000, 8)
    assert t.parts["disk tier"] == pytest.approx(9e9 / hw.disk_bytes_per_s)
    assert t.seconds == pytest.approx(sum(t.parts.values()))
    assert predict({"flops:gemm": 10**15}, hw, 1000, 8).parts["disk tier"] == 0


def _deep_and_full(rank, world_size):
    from megatron_upipe.planner.depth import simulate_deep
    from megatron_upipe.planner.simulate import simulate_step

    torch.distributed.destroy_process_group()  # the planner makes its own fake world
    base = ["model.preset=tiny-gqa", "model.num_layers=6", "parallel.cp=2", "parallel.cp_strategy=upipe",
            "train.seq_length=512", "train.bf16=false", "model.vocab_size=256", "data.path=mock",
            "train.micro_batch_size=1", "memory.recompute=full", "memory.offload_checkpoints=true",
            "memory.offload_disk_dir=/nonexistent"]
    out = {}
    for n in (0, 2, 4):
        config = load_config(None, [*base, f"memory.offload_disk_layers={n}"])
        out[n] = (simulate_deep(config, 2, 256), simulate_step(config, 2, 256))
    return out


def test_planner_extrapolates_the_disk_tier_as_the_full_simulation_has_it():
    """6 layers from simulations at 2 and 3 (whose depth is below 4 layers on disk): the host pool, the disk's
    writes and reads and the device peak equal the full simulation of the 6 layers with the disk tier."""
    from tests.dist_helper import run_on_ranks

    out = run_on_ranks(_deep_and_full, 1)[0]
    one = 512 // 2 * 64 * 4  # [s/cp, b, D] float32
    for n, (deep, full) in out.items():
        assert deep.host_peak_bytes == full.host_peak_bytes, n
        assert full.host_peak_bytes == out[0][1].host_peak_bytes - n * one, n  # one range is aligned already
        for key in ("bytes:disk_write", "bytes:disk_read"):
            assert deep.work.get(key, 0) == full.work.get(key, 0) == n * one, (n, key)
        assert deep.peak_bytes == full.peak_bytes and full.peak_bytes == out[0][1].peak_bytes, n
