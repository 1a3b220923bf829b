"""What this node can still give the job, read from /proc and /sys at start-up under a `root` path (tests pass a
directory of fake files); host_budget.py compares it with the host plan of the node's ranks.

  MemAvailable      /proc/meminfo
  cgroup room       the job's memory cgroup (v2 memory.max, v1 memory.limit_in_bytes), over its cgroup and every
                    ancestor: limit - (usage - its file pages), since the page cache charged to it is reclaimed before
                    the limit bites
  per NUMA node     free and reclaimable memory (/sys/devices/system/node/nodeN/meminfo: MemFree + file pages +
                    SReclaimable), MemTotal beside it
  GPU's NUMA node   /sys/bus/pci/devices/<bus id>/numa_node of each local rank's CUDA device (local rank r runs on
                    device r); -1 is unknown
`NodeMemory.usable` is the least of MemAvailable, the cgroup room and memory.host_mem_gib if set; it already excludes
what the starting ranks hold (a few GiB each, which host_budget's process margin counts again).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

GIB = 1 << 30
UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as 2^63 rounded down to a page


@dataclass(frozen=True)
class NodeMemory:
    """What this node can still give the job (bytes), read at start-up by `read_node_memory`."""

    mem_available: int  # /proc/meminfo MemAvailable
    cgroup_room: int | None = None  # the job's memory cgroup: the least room over it and its ancestors; None: no limit
    numa: dict[int, tuple[int, int]] = field(default_factory=dict)  # NUMA node -> (free + reclaimable, MemTotal)

    def usable(self, host_mem_gib: float | None = None) -> tuple[int, str]:
        """The least of MemAvailable, the cgroup's room and memory.host_mem_gib, and what it was the least of."""
        figures = [(self.mem_available, f"MemAvailable {self.mem_available / GIB:.1f} GiB")]
        if self.cgroup_room is not None:
            figures.append((self.cgroup_room, f"the job's cgroup room {self.cgroup_room / GIB:.1f} GiB"))
        if host_mem_gib is not None:
            figures.append((int(host_mem_gib * GIB), f"memory.host_mem_gib={host_mem_gib:g}"))
        least = min(n for n, _ in figures)
        return least, "usable now: the least of " + ", ".join(w for _, w in figures)


def _meminfo(path: Path) -> dict[str, int]:
    """A meminfo file (/proc/meminfo, or a NUMA node's with its "Node N " prefix) as bytes by field name."""
    out = {}
    for line in path.read_text().splitlines():
        m = re.match(r"(?:Node \d+ )?([\w()]+):\s+(\d+)(?: kB)?", line)
        if m:
            out[m[1]] = int(m[2]) * (1024 if line.rstrip().endswith("kB") else 1)
    return out


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" (v2): no limit


def _cgroup_room(root: Path) -> int | None:
    """The least room (limit - (usage - file pages)) over this process's memory cgroup and its ancestors, v1 or v2;
    None where no level has a limit or the cgroup cannot be read."""
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    entries = [line.split(":", 2) for line in lines if line.count(":") >= 2]
    v1 = next((path for _, ctl, path in entries if "memory" in ctl.split(",")), None)
    if v1 is not None:
        base, rel, names = root / "sys/fs/cgroup/memory", v1, ("memory.limit_in_bytes", "memory.usage_in_bytes",
                                                                "total_active_file", "total_inactive_file")
    else:
        rel = next((path for hier, ctl, path in entries if hier == "0" and ctl == ""), None)
        if rel is None:
            return None
        base, names = root / "sys/fs/cgroup", ("memory.max", "memory.current", "active_file", "inactive_file")
    room = None
    here = base / rel.lstrip("/")  # in a cgroup namespace the mount is our own cgroup: the path is not under it
    while True:
        limit, usage = _read_int(here / names[0]), _read_int(here / names[1])
        if limit is not None and limit < UNLIMITED and usage is not None:
            stat = {}
            if (here / "memory.stat").exists():
                stat = dict(ln.split() for ln in (here / "memory.stat").read_text().splitlines() if ln.count(" ") == 1)
            file_pages = sum(int(stat.get(k, 0)) for k in names[2:])
            level = max(limit - max(usage - file_pages, 0), 0)
            room = level if room is None else min(room, level)
        if here == base or base not in here.parents:
            return room
        here = here.parent


def read_node_memory(root: Path = Path("/")) -> NodeMemory:
    """MemAvailable, the cgroup's room and each NUMA node's free + reclaimable memory and MemTotal, read from
    /proc and /sys under `root` (tests pass a directory of fake files)."""
    info = _meminfo(root / "proc/meminfo")
    numa = {}
    for d in sorted((root / "sys/devices/system/node").glob("node[0-9]*")):
        if (d / "meminfo").exists():
            m = _meminfo(d / "meminfo")
            free = m.get("MemFree", 0) + m.get("Active(file)", 0) + m.get("Inactive(file)", 0) + m.get(
                "SReclaimable", 0)
            numa[int(d.name[4:])] = (min(free, m.get("MemTotal", free)), m.get("MemTotal", 0))
    return NodeMemory(info.get("MemAvailable", info.get("MemFree", 0)), _cgroup_room(root), numa)


def gpu_numa_nodes(bus_ids: list[str] | None, numa_nodes: int, root: Path = Path("/")) -> list[int] | str:
    """The NUMA node of each local rank's GPU (PCI bus ids "0000:18:00.0", local rank order), or why unknown."""
    if not bus_ids:
        return "no CUDA device"
    out = []
    for bus in bus_ids:
        node = _read_int(root / "sys/bus/pci/devices" / bus.lower() / "numa_node")  # -1 reads as None
        if node is None:
            if numa_nodes > 1:
                return f"GPU {bus} reports no NUMA node"
            node = 0
        out.append(node)
    return out


def local_gpu_bus_ids(local_ranks: int) -> list[str] | None:
    """The PCI bus ids of CUDA devices 0..local_ranks-1 (local rank r runs on device r: training/setup.py), or None
    without CUDA or with fewer visible devices than local ranks."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() < local_ranks:
        return None
    ids = []
    for i in range(local_ranks):
        p = torch.cuda.get_device_properties(i)
        ids.append(f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0")  # sysfs form, as torch.numa
    return ids
