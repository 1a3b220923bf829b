"""The start-up host memory check against what the node really has, per node and per NUMA node; no fork after pinning.

- `read_node_memory` on fake /proc and /sys trees: MemAvailable; the job's memory cgroup (v2 with Slurm's nested
  cgroups, where the limit sits on an ancestor; v2 inside a cgroup namespace; v1), whose room is its limit less its
  usage net of page cache; each NUMA node's free + reclaimable memory and MemTotal. A GPU's NUMA node comes from
  /sys/bus/pci/devices/<bus id>/numa_node (-1 is node 0 on a one-node machine, unknown on a two-socket one).
- The verdict: usable = the least of MemAvailable, the cgroup's room and memory.host_mem_gib (which can lower the
  figure, not raise it); a node whose ranks do not fit is refused in one line, so is a NUMA node whose ranks' GPUs sit
  there and do not fit there; without GPUs the per-socket check is skipped and the start-up line says so.
- `host_memory_refusal` on this CPU machine with a fake root: the tiny model's plan refused in one line where the node
  is small, accepted with its start-up line where it is not.
- No fork after pinning: one tiny training run (1 rank, data.num_workers=1, the offloader's pool on) creates the
  training DataLoader's iterator (which forks the worker) before the pool, and the loop uses that one.
"""

from __future__ import annotations

from pathlib import Path

from megatron_upipe.config import load_config, validate
from megatron_upipe.memory_switches import host_budget as hb
from tests.dist_helper import run_on_ranks

GIB = 1 << 30
KB = 1024


def write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def fake_node(root: Path, *, available_gib: float, numa: dict[int, tuple[float, float]] | None = None,
              gpus: dict[str, int] | None = None) -> Path:
    """/proc/meminfo, NUMA nodes {n: (free GiB, MemTotal GiB)}, PCI devices {bus id: numa_node}; no cgroup limit."""
    kb = lambda gib: int(gib * GIB // KB)  # noqa: E731
    write(root, "proc/meminfo", f"MemTotal:       {kb(2 * available_gib)} kB\nMemFree:        {kb(1)} kB\n"
                                f"MemAvailable:   {kb(available_gib)} kB\nHugePages_Total:       0\n")
    write(root, "proc/self/cgroup", "0::/\n")
    for n, (free, total) in (numa or {}).items():
        # free memory split over MemFree, page cache and reclaimable slab, as the kernel reports it
        write(root, f"sys/devices/system/node/node{n}/meminfo",
              f"Node {n} MemTotal:       {kb(total)} kB\nNode {n} MemFree:        {kb(free / 2)} kB\n"
              f"Node {n} Active(file):   {kb(free / 4)} kB\nNode {n} Inactive(file): {kb(free / 8)} kB\n"
              f"Node {n} Active(anon):   {kb(3)} kB\nNode {n} SReclaimable:   {kb(free / 8)} kB\n")
    for bus, n in (gpus or {}).items():
        write(root, f"sys/bus/pci/devices/{bus}/numa_node", f"{n}\n")
    return root


# --- reading the node -----------------------------------------------------------------------------------------------
def test_reads_meminfo_numa_nodes_and_gpu_sockets(tmp_path):
    root = fake_node(tmp_path, available_gib=1900, numa={0: (950, 1007.5), 1: (940, 1007.5)},
                     gpus={"0000:18:00.0": 0, "0000:9a:00.0": 1, "0000:ab:00.0": -1})
    node = hb.read_node_memory(root)
    assert node.mem_available == 1900 * GIB and node.cgroup_room is None
    assert node.numa == {0: (950 * GIB, int(1007.5 * GIB)), 1: (940 * GIB, int(1007.5 * GIB))}
    assert node.usable() == (1900 * GIB, "usable now: the least of MemAvailable 1900.0 GiB")
    assert node.usable(2048) == (1900 * GIB, "usable now: the least of MemAvailable 1900.0 GiB, "
                                             "memory.host_mem_gib=2048")  # host_mem_gib lowers, never raises
    assert node.usable(1024)[0] == 1024 * GIB
    assert hb.gpu_numa_nodes(["0000:18:00.0", "0000:9A:00.0"], 2, root) == [0, 1]  # sysfs names are lower case
    assert hb.gpu_numa_nodes(["0000:ab:00.0"], 2, root) == "GPU 0000:ab:00.0 reports no NUMA node"
    assert hb.gpu_numa_nodes(["0000:ab:00.0"], 1, root) == [0]  # -1 on a one-node machine: that node
    assert hb.gpu_numa_nodes(None, 2, root) == "no CUDA device"


def _cgroup_files(d: Path, limit: str, usage_gib: float, file_gib: float, v1: bool = False) -> None:
    d.mkdir(parents=True, exist_ok=True)
    names = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_") if v1 else ("memory.max", "memory.current", "")
    (d / names[0]).write_text(limit + "\n")
    (d / names[1]).write_text(f"{int(usage_gib * GIB)}\n")
    half = int(file_gib * GIB / 2)
    (d / "memory.stat").write_text(f"{names[2]}anon 5\n{names[2]}active_file {half}\n{names[2]}inactive_file {half}\n")


def test_cgroup_room_v2_nested_v2_namespace_and_v1(tmp_path):
    # Slurm, cgroup v2: the limit on the job's cgroup, none on the step and task below it (where the process is)
    root = fake_node(tmp_path / "v2", available_gib=1900)
    write(root, "proc/self/cgroup", "0::/system.slice/slurmstepd.scope/job_7/step_0/user/task_0\n")
    job = root / "sys/fs/cgroup/system.slice/slurmstepd.scope/job_7"
    _cgroup_files(job, str(1000 * GIB), usage_gib=300, file_gib=100)  # 200 GiB not reclaimable: 800 GiB room
    _cgroup_files(job / "step_0", "max", usage_gib=290, file_gib=100)
    _cgroup_files(job / "step_0/user/task_0", "max", usage_gib=10, file_gib=0)
    node = hb.read_node_memory(root)
    assert node.cgroup_room == 800 * GIB
    assert node.usable() == (800 * GIB, "usable now: the least of MemAvailable 1900.0 GiB, the job's cgroup room "
                                        "800.0 GiB")

    # inside a cgroup namespace: /proc/self/cgroup says "/", the mount is the job's own cgroup
    root = fake_node(tmp_path / "ns", available_gib=1900)
    _cgroup_files(root / "sys/fs/cgroup", str(64 * GIB), usage_gib=4, file_gib=1)
    assert hb.read_node_memory(root).cgroup_room == 61 * GIB

    # cgroup v1 (memory controller's own hierarchy); "unlimited" is 2^63 rounded down to a page
    root = fake_node(tmp_path / "v1", available_gib=1900)
    write(root, "proc/self/cgroup", "5:devices:/\n4:memory:/slurm/uid_1/job_7\n0::/\n")
    _cgroup_files(root / "sys/fs/cgroup/memory/slurm/uid_1/job_7", str(500 * GIB), usage_gib=50, file_gib=30, v1=True)
    _cgroup_files(root / "sys/fs/cgroup/memory", "9223372036854771712", usage_gib=900, file_gib=0, v1=True)
    assert hb.read_node_memory(root).cgroup_room == 480 * GIB


# --- the verdict ----------------------------------------------------------------------------------------------------
def _host(per_rank_gib: float, ranks: int, capacity_gib: float) -> hb.HostPlan:
    return hb.HostPlan(int((per_rank_gib - 6) * GIB), 0, 6 * GIB, ranks, 2 * GIB, int(capacity_gib * GIB),
                       "usable now: the least of MemAvailable")


def test_node_and_socket_verdicts_in_one_line():
    node = hb.NodeMemory(1900 * GIB, None, {0: (950 * GIB, 1007 * GIB), 1: (800 * GIB, 1007 * GIB)})
    sockets = [0, 0, 0, 0, 1, 1, 1, 1]  # DGX H100: GPUs 0-3 on socket 0, 4-7 on socket 1

    refusal, line = hb.node_verdict(_host(190, 8, 1900), node, sockets)  # 1522 GiB: fits the node and each socket
    assert refusal is None and "\n" not in line
    assert "per NUMA node (free + reclaimable): node 0: 4 ranks 760.0 of 950.0 GiB, node 1: 4 ranks 760.0 of " \
           "800.0 GiB" in line

    refusal, _ = hb.node_verdict(_host(205, 8, 1900), node, sockets)  # 1642 GiB fits the node, 820 not socket 1
    assert refusal is not None and "\n" not in refusal
    assert refusal.startswith("host memory does not fit on NUMA node 1: its 4 ranks (local ranks [4, 5, 6, 7]")
    assert "820.0 GiB (205.0 each) but it has 800.0 GiB free or reclaimable (MemTotal 1007.0 GiB)" in refusal
    assert "memory.offload_checkpoints=false" in refusal

    refusal, _ = hb.node_verdict(_host(240, 8, 1900), node, sockets)  # 1922 GiB > 1900
    assert refusal.startswith("host memory does not fit on this node: host 240.0 GiB per rank") and "\n" not in refusal
    assert "1922.0 GiB per node of 8 ranks (+ os 2.0) of 1900.0 GiB" in refusal

    refusal, line = hb.node_verdict(_host(205, 8, 1900), node, "no CUDA device")  # unknown sockets: skipped, said
    assert refusal is None
    assert line.endswith("per NUMA node not checked: GPUs' NUMA nodes unknown (no CUDA device)")


def test_planner_host_capacity_is_the_stated_usable_figure():
    # a DGX H100/H200 node's MemTotal as derived in host_budget.py (2,048 GiB of DIMMs less 1/64 for struct page and
    # the reservations), not its nominal 2 TiB; the recipe tables and headers are planned against it
    assert hb.PLANNER_HOST_GIB == 2010.0
    assert hb.PLANNER_HOST_GIB <= 2048 * (1 - 1 / 64)
    assert not hasattr(hb, "USABLE_HOST_GIB") and not hasattr(hb, "USABLE_HOST_GIB_UNCERTAINTY")


# --- the start-up check on this machine, with a fake node -----------------------------------------------------------
TINY_OFFLOAD = ["model.preset=tiny", "model.vocab_size=256", "data.path=mock", "train.bf16=false",
                "parallel.cp=2", "parallel.cp_strategy=upipe", "train.seq_length=4096", "train.global_batch_size=1",
                "memory.recompute=full", "memory.offload_checkpoints=true"]


def _refusal(root: Path, *over: str):
    import torch

    config = load_config(None, [*TINY_OFFLOAD, *over])
    notes = []
    refusal = hb.host_memory_refusal(config, validate(config, 2), 256, bf16=False, device=torch.device("cpu"),
                                     world_size=2, notes=notes, root=root)
    return refusal, notes


def test_start_up_check_reads_the_node_and_refuses_in_one_line(tmp_path, monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)  # both ranks on this node
    # 2 CPU ranks x (1 GiB process margin + a 2 x [2048, 1, 64] float32 pool) + os 2 GiB: just over 4 GiB
    small = fake_node(tmp_path / "small", available_gib=3.5, numa={0: (3.5, 8)})
    refusal, notes = _refusal(small)
    assert refusal is not None and "\n" not in refusal and len(notes) == 1
    assert refusal.startswith("host memory does not fit on this node:") and "MemAvailable 3.5 GiB" in refusal
    assert "memory.offload_checkpoints=false" in refusal

    big = fake_node(tmp_path / "big", available_gib=64, numa={0: (64, 128)})
    refusal, notes = _refusal(big)
    assert refusal is None and len(notes) == 1
    assert "of 64.0 GiB (usable now: the least of MemAvailable 64.0 GiB)" in notes[0]
    assert "per NUMA node not checked: GPUs' NUMA nodes unknown (no CUDA device)" in notes[0]

    refusal, _ = _refusal(big, "memory.host_mem_gib=3")  # the user's figure lowers the usable memory
    assert refusal is not None and "memory.host_mem_gib=3" in refusal
    assert _refusal(small, "memory.host_mem_gib=64")[0] is not None  # and cannot raise it above the node's


# --- no fork after pinning ------------------------------------------------------------------------------------------
def _order_job(rank, world_size, tmp):
    import torch.utils.data

    import megatron_upipe.memory_switches.offload as offload
    from tests.train_harness import SMALL, run_main

    order = []
    real_pool, real_iter = offload.HostPool, torch.utils.data.DataLoader.__iter__

    def pool(*args, **kwargs):
        order.append("pinned pool")
        return real_pool(*args, **kwargs)

    def iterator(self):
        order.append(f"data iterator ({self.num_workers} worker)")
        return real_iter(self)

    offload.HostPool, torch.utils.data.DataLoader.__iter__ = pool, iterator
    code, err = run_main(*SMALL, "parallel.cp=1", "parallel.cp_strategy=none", "train.steps=2", "data.num_workers=1",
                         "memory.recompute=full", "memory.offload_checkpoints=true", f"log.metrics_file={tmp}/m.jsonl")
    return code, err, order


def test_data_workers_fork_before_the_pool_is_pinned(tmp_path):
    ((code, err, order),) = run_on_ranks(_order_job, 1, str(tmp_path))
    assert code == 0, err
    assert order == ["data iterator (1 worker)", "pinned pool"], order  # and the loop took that iterator
