"""Host memory per rank and per node, planned from the config before anything is allocated, and the start-up check
against `memory.host_mem_gib`.

Legend: L layers of a pipeline stage, s sequence length, C context-parallel size, b micro-batch size, D hidden
size, P parameters of a rank's stage (tensor-parallel shards), p bytes of a parameter (2 bf16, 4 fp32).

Per rank (`HostPlan.breakdown`):
  offload pool        memory.offload_checkpoints: the one host buffer of the offloader (pinned_pool.HostPool), exactly
                      the layer inputs alive at once: L x micro-batches in flight (1 without pipelining; the 1F1B
                      schedule keeps min(pp - stage, micro-batches) on a stage) x [s/C (/tp with sequence
                      parallelism), b, D] in the activation dtype, each range rounded up to pinned_pool.ALIGN;
                      memory.offload_disk_layers = N of them go to disk instead (N fewer in the pool; disk_bytes).
  checkpoint staging  checkpoint.dir set: a save first copies this rank's model states to host memory
                      (training/checkpointing.py):
                      - "fsdp_per_rank" (memory.shard_model_states): `.cpu()` copies of the local buffer slices
                        (params, fp32 main params) and of Adam's two fp32 moments, all alive together in the dict that
                        torch.save writes. Pageable, exact: (p + 4 + 8) x P / (dp x C) bytes (no main copy at p = 4).
                      - "dist_checkpointing": megatron-core's FileSystemWriterAsync.preload_tensors copies each tensor
                        the rank writes with `.to("cpu", non_blocking=True)`, which allocates pinned memory from
                        torch's caching host allocator: each tensor rounded up to a power of two, and those blocks
                        stay cached after the save (so they count for the rest of the run). Counted as rank 0 saves
                        (it holds replica 0 of every weight): each weight of the stage in its dtype, and its fp32 main
                        copy and two moments (sharded over dp x C with the distributed optimizer), each rounded.
  optimizer states    memory.offload_optimizer_states: one host buffer per parked storage (optimizer_parking.py),
                      pinned, allocated at its first parking and kept: Adam's two fp32 moments and, at p < 4, the
                      fp32 main weights of the rank's optimizer shard: (8 + 4) x P / (dp x C) with
                      memory.shard_model_states or train.distributed_optimizer (each tensor's shard rounded up),
                      else (8 + 4) x P (8 x P at p = 4). Megatron-FSDP's bucket padding is not counted
                      (tests/test_optimizer_parking.py bounds it).
  margin: process     the process itself (HostMargins, stated): torch/CUDA/NCCL libraries and their host buffers, the
                      data loader.
Per node: per rank x ranks on the node (every rank counted as pipeline stage 0, the one with the most in flight)
+ margin: os.

Capacity in the memory planner: memory.host_mem_gib (per node), unset PLANNER_HOST_GIB (2,010 GiB: what Linux reports
as MemTotal on a DGX H100/H200 node of 2 TiB, derived below, not measured); margin: os then comes off it.

At start-up (`host_memory_refusal`, every rank, before the model or the pinned pool exists) each node compares what
it can still give the job (node_memory.py `read_node_memory`: the least of MemAvailable, the room left in the job's
memory cgroup and memory.host_mem_gib if set) with the plan of its LOCAL_WORLD_SIZE ranks (+ margin: os), and per
NUMA node the ranks whose GPU sits there (node_memory.py `gpu_numa_nodes`) with that node's free and reclaimable
memory (MemTotal named beside it). Pages are placed by first touch, so the per-socket figure holds for ranks bound
to their GPU's socket (numactl, torchrun's NUMA binding). Where a GPU's node is unknown (no CUDA device, fewer visible
devices than local ranks, numa_node -1 on a two-socket machine) the per-socket check is skipped and the start-up line
says so.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

# Reading the node's memory lives in node_memory.py; these names stay importable from here (tests, the planner).
from megatron_upipe.memory_switches.node_memory import (GIB, NodeMemory, gpu_numa_nodes, local_gpu_bus_ids,
                                                     read_node_memory)
from megatron_upipe.memory_switches.pinned_pool import aligned

if TYPE_CHECKING:
    from megatron_upipe.config import Config, Plan

# Host RAM per node the planner assumes when memory.host_mem_gib is unset: the MemTotal of a DGX H100/H200 node, not
# its 2 TB of DIMMs (DGX H100/H200 datasheets: 2 TB system memory, 2,048 GiB). Linux's MemTotal leaves out the kernel's
# page metadata (a 64-byte `struct page` per 4 KiB page: 1/64 of 2,048 GiB = 32 GiB) and the firmware's and kernel's
# reservations, about 2,010-2,020 GiB in all; the lower end is taken. A derivation, not a measurement on such a node
# (none here); the job's start-up check reads the real node (`host_memory_refusal`). HostMargins.os_fraction (2% of
# this) then comes off it in the plan.
PLANNER_HOST_GIB = 2010.0
PLANNER_RANKS_PER_NODE = 8  # GPUs per node the planner assumes (DGX/HGX H100, H200, B200)
OFFLOAD_POOL = "offload pool"  # the host breakdown's entry for the offloaded layer inputs (read by planner/fastest.py)


@dataclass(frozen=True)
class HostMargins:
    """Host memory outside the plan's tensors, stated rather than measured."""

    process_cuda_bytes: int = 6 * GIB  # one CUDA rank: torch, CUDA runtime, cuBLAS/cuDNN/NCCL and their host buffers
    process_cpu_bytes: int = GIB  # one CPU rank (gloo; this project's test machines)
    os_fraction: float = 0.02  # of the node's RAM, for the kernel, page tables of pinned memory, daemons
    os_min_bytes: int = 2 * GIB

    def process_bytes(self, cuda: bool) -> int:
        return self.process_cuda_bytes if cuda else self.process_cpu_bytes

    def os_bytes(self, host_mem_bytes: int) -> int:
        return max(self.os_min_bytes, int(host_mem_bytes * self.os_fraction))


def ranks_on_this_node(world_size: int) -> int:
    """LOCAL_WORLD_SIZE (torchrun sets it), else the whole world (every rank on this machine: the safe guess)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE") or world_size)


def layers_in_flight(config: "Config", plan: "Plan", pp_rank: int = 0) -> int:
    """Layer inputs a rank of pipeline stage `pp_rank` holds at once: recomputed layers of the stage (all L/pp, or
    memory.recompute_layers) x micro-batches in flight."""
    pp = config.parallel.pp
    in_flight = 1 if pp == 1 else min(pp - pp_rank, plan.num_microbatches)
    layers = plan.arch.num_layers // pp
    if config.memory.recompute_layers is not None:
        layers = min(layers, config.memory.recompute_layers)
    return layers * in_flight


def layer_input_bytes(config: "Config", plan: "Plan", dtype_bytes: int) -> int:
    """One transformer layer's input on a rank: [s/C (/tp with sequence parallelism), b, D]."""
    p = config.parallel
    tokens = plan.seq_per_cp_rank // (p.tp if p.sequence_parallel else 1)
    return tokens * plan.micro_batch_size * plan.arch.hidden_size * dtype_bytes


def offload_pool_bytes(config: "Config", plan: "Plan", dtype_bytes: int, pp_rank: int = 0) -> int:
    """The offload pool of a rank of stage `pp_rank` (0 without memory.offload_checkpoints); see the docstring."""
    if not config.memory.offload_checkpoints:
        return 0
    layers = layers_in_flight(config, plan, pp_rank) - config.memory.offload_disk_layers
    return layers * aligned(layer_input_bytes(config, plan, dtype_bytes))


def disk_bytes(config: "Config", plan: "Plan", dtype_bytes: int) -> int:
    """Bytes a rank keeps on the disk tier at once (memory.offload_disk_layers layer inputs)."""
    return config.memory.offload_disk_layers * layer_input_bytes(config, plan, dtype_bytes)


def disk_refusal(config: "Config", plan: "Plan", *, bf16: bool, world_size: int) -> str | None:
    """The start-up check of the disk tier (every rank, before anything is written): the one-line error when
    memory.offload_disk_dir is missing, not writable, or has less free space than this node's ranks keep there."""
    import shutil

    need = disk_bytes(config, plan, 2 if bf16 else 4) * ranks_on_this_node(world_size)
    if need == 0:
        return None
    where = config.memory.offload_disk_dir
    if not os.path.isdir(where) or not os.access(where, os.W_OK):
        return (f"memory.offload_disk_dir={where} is not a writable directory: create it on a local disk (e.g. "
                f"/raid/upipe) or set memory.offload_disk_layers=0")
    free = shutil.disk_usage(where).free
    if free < need:
        return (f"memory.offload_disk_dir={where} has {free / GIB:.1f} GiB free but this node's ranks keep "
                f"{need / GIB:.1f} GiB there (memory.offload_disk_layers={config.memory.offload_disk_layers}): free "
                f"space there or lower memory.offload_disk_layers")
    return None


def stage_weight_numels(config: "Config", plan: "Plan", vocab_size: int, pp_rank: int = 0) -> list[int]:
    """Elements of each weight tensor of a rank of stage `pp_rank` (its tensor-parallel shards)."""
    a, tp, pp = plan.arch, config.parallel.tp, config.parallel.pp
    D, d, h, g, F = a.hidden_size, a.kv_channels, a.num_attention_heads, a.num_query_groups, a.ffn_hidden_size
    layer = [(h + 2 * g) * d // tp * D, D * (h * d // tp), 2 * F // tp * D, D * (F // tp), D, D]  # qkv, proj,
    out = layer * (a.num_layers // pp)  # fc1, fc2, the two norms
    step = math.lcm(config.model.make_vocab_size_divisible_by, tp)  # the padded embedding rows, over tp
    vocab = -(-vocab_size // step) * step // tp
    if pp_rank == 0:
        out.append(vocab * D)  # embedding
    if pp_rank == pp - 1:
        out += [vocab * D, D]  # output layer (untied), final norm
    return out


def checkpoint_staging_bytes(config: "Config", plan: "Plan", vocab_size: int, param_bytes: int,
                             pp_rank: int = 0) -> int:
    """Host bytes a checkpoint save stages on a rank (0 without checkpoint.dir); see the module docstring."""
    if config.checkpoint.dir is None:
        return 0
    numels = stage_weight_numels(config, plan, vocab_size, pp_rank)
    main = 4 if param_bytes != 4 else 0  # fp32 main params beside 16-bit ones
    shards = plan.dp * config.parallel.cp
    if config.memory.shard_model_states:  # fsdp_per_rank: pageable, exact sizes
        return -(-sum(numels) // shards) * (param_bytes + main + 8)
    opt_shards = shards if config.train.distributed_optimizer else 1
    pinned = 0
    for n in numels:
        pinned += _pow2(n * param_bytes)
        pinned += (3 if main else 2) * _pow2(-(-n // opt_shards) * 4)
    return pinned


def optimizer_states_bytes(config: "Config", plan: "Plan", vocab_size: int, param_bytes: int,
                           pp_rank: int = 0) -> int:
    """Host bytes of the parked optimizer states on a rank (0 without memory.offload_optimizer_states); see the
    module docstring."""
    if not config.memory.offload_optimizer_states:
        return 0
    numels = stage_weight_numels(config, plan, vocab_size, pp_rank)
    per_element = 8 + (4 if param_bytes != 4 else 0)  # two moments (+ the fp32 main weight)
    shards = plan.dp * config.parallel.cp
    if config.memory.shard_model_states:
        return -(-sum(numels) // shards) * per_element
    if config.train.distributed_optimizer:
        return sum(-(-n // shards) for n in numels) * per_element
    return sum(numels) * per_element


def _pow2(nbytes: int) -> int:
    return 1 << max(nbytes - 1, 0).bit_length()


@dataclass(frozen=True)
class HostPlan:
    offload_pool_bytes: int  # per rank
    checkpoint_staging_bytes: int  # per rank
    process_bytes: int  # per rank (margin)
    ranks_per_node: int
    os_bytes: int  # per node (margin)
    host_mem_bytes: int  # capacity per node
    capacity_source: str  # where host_mem_bytes came from
    optimizer_states_bytes: int = 0  # per rank: memory.offload_optimizer_states

    @property
    def per_rank_bytes(self) -> int:
        return self.offload_pool_bytes + self.checkpoint_staging_bytes + self.optimizer_states_bytes + \
            self.process_bytes

    @property
    def per_node_bytes(self) -> int:
        return self.per_rank_bytes * self.ranks_per_node + self.os_bytes

    @property
    def fits(self) -> bool:
        return self.per_node_bytes <= self.host_mem_bytes

    @property
    def breakdown(self) -> dict[str, int]:
        """Per rank, by name (the planner's host breakdown)."""
        parked = {"optimizer states": self.optimizer_states_bytes} if self.optimizer_states_bytes else {}
        return {OFFLOAD_POOL: self.offload_pool_bytes, "checkpoint staging": self.checkpoint_staging_bytes,
                **parked, "margin: process": self.process_bytes}

    def summary(self) -> str:
        return (f"host {self.per_rank_bytes / GIB:.1f} GiB per rank (offload pool {self.offload_pool_bytes / GIB:.1f}"
                f" + checkpoint staging {self.checkpoint_staging_bytes / GIB:.1f}"
                + (f" + optimizer states {self.optimizer_states_bytes / GIB:.1f}"
                   if self.optimizer_states_bytes else "")
                + " + process "
                f"{self.process_bytes / GIB:.1f}), {self.per_node_bytes / GIB:.1f} GiB per node of "
                f"{self.ranks_per_node} ranks (+ os {self.os_bytes / GIB:.1f}) of {self.host_mem_bytes / GIB:.1f} "
                f"GiB ({self.capacity_source})")

    def refusal(self) -> str:
        """The one-line error when the plan does not fit."""
        return (f"host memory does not fit: {self.summary()}. Set memory.host_mem_gib to the node's RAM if it has "
                f"more; otherwise shorten train.seq_length, spread the job over more nodes (fewer ranks per node, a "
                f"larger parallel.cp), or set memory.offload_checkpoints=false (checkpoint.dir unset removes the "
                f"staging)")


def plan_host_memory(config: "Config", plan: "Plan", vocab_size: int, *, bf16: bool, cuda: bool,
                     ranks_per_node: int, host_mem_bytes: int | None = None, capacity_source: str | None = None,
                     margins: HostMargins = HostMargins()) -> HostPlan:
    """The host plan of `config` (every rank counted as pipeline stage 0). Capacity: memory.host_mem_gib if set,
    else `host_mem_bytes` (PLANNER_HOST_GIB in the planner), else what this machine can give now
    (`read_node_memory`). The start-up check passes its usable figure as `host_mem_bytes` with a config whose
    host_mem_gib it has already folded in (`startup_host_plan`)."""
    width = 2 if bf16 else 4
    if config.memory.host_mem_gib is not None:
        capacity, source = int(config.memory.host_mem_gib * GIB), f"memory.host_mem_gib={config.memory.host_mem_gib:g}"
    elif host_mem_bytes is None:
        capacity, source = read_node_memory().usable()
    else:
        capacity, source = host_mem_bytes, capacity_source or "memory.host_mem_gib unset"
    return HostPlan(offload_pool_bytes(config, plan, width), checkpoint_staging_bytes(config, plan, vocab_size, width),
                    margins.process_bytes(cuda), ranks_per_node, margins.os_bytes(capacity), capacity, source,
                    optimizer_states_bytes(config, plan, vocab_size, width))


def startup_host_plan(config: "Config", plan: "Plan", vocab_size: int, node: NodeMemory, *, bf16: bool, cuda: bool,
                      ranks_per_node: int) -> HostPlan:
    """The host plan of this node's ranks against what the node can give now (`NodeMemory.usable`)."""
    import dataclasses

    usable, source = node.usable(config.memory.host_mem_gib)
    unset = dataclasses.replace(config, memory=dataclasses.replace(config.memory, host_mem_gib=None))
    return plan_host_memory(unset, plan, vocab_size, bf16=bf16, cuda=cuda, ranks_per_node=ranks_per_node,
                            host_mem_bytes=usable, capacity_source=source)


FIX = ("shorten train.seq_length, spread the job over more nodes (fewer ranks per node, a larger parallel.cp), or set "
       "memory.offload_checkpoints=false (checkpoint.dir unset removes the staging)")


def node_verdict(host: HostPlan, node: NodeMemory, gpu_nodes: list[int] | str) -> tuple[str | None, str]:
    """(the one-line refusal, or None when this node's plan fits as a whole and per NUMA node; the start-up line).
    `gpu_nodes`: each local rank's GPU's NUMA node (`gpu_numa_nodes`), or why they are unknown."""
    if not host.fits:
        return (f"host memory does not fit on this node: {host.summary()}: free memory on the node, or " + FIX,
                f"host memory check: {host.summary()}")
    if isinstance(gpu_nodes, str):
        return None, (f"host memory check: {host.summary()}; per NUMA node not checked: GPUs' NUMA nodes unknown "
                      f"({gpu_nodes})")
    per_socket = []
    for n in sorted(set(gpu_nodes)):
        ranks = [r for r, g in enumerate(gpu_nodes) if g == n]
        need = len(ranks) * host.per_rank_bytes
        have, total = node.numa.get(n, (None, None))
        if have is None:
            per_socket.append(f"node {n}: {len(ranks)} ranks, its memory unknown (not checked)")
            continue
        per_socket.append(f"node {n}: {len(ranks)} ranks {need / GIB:.1f} of {have / GIB:.1f} GiB")
        if need > have:
            return (f"host memory does not fit on NUMA node {n}: its {len(ranks)} ranks (local ranks {ranks}, whose "
                    f"GPUs sit there) plan {need / GIB:.1f} GiB ({host.per_rank_bytes / GIB:.1f} each) but it has "
                    f"{have / GIB:.1f} GiB free or reclaimable (MemTotal {total / GIB:.1f} GiB), and the rest would be "
                    f"placed on the other socket: free memory there, or " + FIX,
                    f"host memory check: {host.summary()}")
    return None, f"host memory check: {host.summary()}; per NUMA node (free + reclaimable): {', '.join(per_socket)}"


def host_memory_refusal(config: "Config", plan: "Plan", vocab_size: int, *, bf16: bool, device,
                        world_size: int, notes: list | None = None, root: Path = Path("/")) -> str | None:
    """The start-up check (every rank, before the model or the pinned pool is allocated): None when the host plan
    fits on every node (as a whole and per NUMA node) and the disk tier has room (`disk_refusal`), else the one-line
    error; the start-up line goes to `notes`.
    One all-reduce, so every rank reaches the same verdict. `root`: where /proc and /sys are read (tests)."""
    import torch
    import torch.distributed as dist

    cuda = device.type == "cuda"
    local = ranks_on_this_node(world_size)
    node = read_node_memory(root)
    host = startup_host_plan(config, plan, vocab_size, node, bf16=bf16, cuda=cuda, ranks_per_node=local)
    gpus = gpu_numa_nodes(local_gpu_bus_ids(local) if cuda else None, len(node.numa), root)
    if cuda and isinstance(gpus, str) and gpus == "no CUDA device":
        gpus = f"fewer visible CUDA devices than the {local} local ranks"
    refusal, line = node_verdict(host, node, gpus)
    refusal = refusal or disk_refusal(config, plan, bf16=bf16, world_size=world_size)
    if notes is not None:
        notes.append(line)
    everywhere = refusal is None
    if dist.is_initialized() and dist.get_world_size() > 1:
        flag = torch.tensor([int(refusal is None)], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        everywhere = bool(flag.item())
    if everywhere:
        return None
    if refusal is None:
        return (f"host memory does not fit on another node (its ranks say why; here: {host.summary()}): free memory "
                f"there, or " + FIX)
    return refusal
