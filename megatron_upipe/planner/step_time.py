"""Step time beside the memory plan: work counted on the planner's own fake run, priced with stated hardware constants.

Counted (per rank, one training step's forward/backward schedule, recomputation included; `WorkCounter`, fed by
the planner's fake mode with every op the step runs):
- GEMM FLOPs: 2·M·K·N of every mm/addmm/bmm/baddbmm (QKV/W_O/MLP/LM-head projections, recomputed ones too);
- attention-kernel FLOPs: per call 4·b·h·d·P forward and 10·b·h·d·P backward (the five products of a flash
  backward, the recomputed QK^T included), P = the (query, key) pairs the mask keeps (N(N+1)/2 for causal);
- bytes each collective sends from this rank, by kind and by link (a group inside one node of `gpus_per_node`
  ranks: NVLink; spanning nodes: InfiniBand): all-to-all (g-1)/g of its input, all-gather (g-1)·input,
  reduce-scatter (g-1)/g of its input, all-reduce 2(g-1)/g, send its tensors; and the number of calls. Those of
  the tensor-parallel group (sequence parallelism's all-gathers and reduce-scatters around every block, the
  all-reduces without it, the vocabulary-parallel loss's) are counted apart, as kinds tp_allgather,
  tp_reduce_scatter and tp_allreduce. The first all-to-all after each attention kernel call is the stage's result
  going back to sequence layout (UPipe's and Ulysses' loops: forward its output, backward its dq): it is also
  counted apart, as a2a_result_forward / a2a_result_backward (a share of alltoall, not added to it).

Priced (`predict`): compute = GEMM FLOPs / (peak · gemm_efficiency) + attention FLOPs / (peak ·
attention_efficiency); the attention all-to-alls and the P2P sends (the hybrid ring's passes, pipeline sends) are on
the critical path: bytes / link bandwidth + calls · latency, except that with `memory.upipe_overlap=true` all but
one stage's share of the all-to-all time hides under the attention kernels; with `memory.upipe_overlap=outputs` the
drained results' all-to-alls hide under the next stage's projection GEMMs (every stage's output in forward but the
last, every stage's dq in backward but each KV round's last: the counted results x (n-1)/n and (n-R)/n for n stages
and R rounds per layer), at most the step's GEMM time (with the stated constants a stage's q projection takes
D·C/(C-1) · link bandwidth / (peak · gemm_efficiency) = 4.3x its output's all-to-all at Llama3-8B's D on 8 H100s,
so the cap does not bind); and with `memory.ring_overlap` the P2P time
does and costs only what exceeds them (pipeline sends, if any, are counted with the ring's); the tensor-parallel
collectives are on the critical path too (each sits between two GEMMs that need its result; megatron-core overlaps
them only with TransformerEngine's userbuffers, which this stack does not set up); Megatron-FSDP's / DDP's
all-gathers, reduce-scatters and all-reduces overlap with compute and cost only what exceeds it (the compute not
already covering hidden all-to-alls). The offloaded layer
inputs' copies back to the device (`bytes:host_to_device`, from the offloader's ledger) are on the critical path:
bytes / host link bandwidth, each before its layer's recompute; with `memory.offload_prefetch` they run during the
next layer's backward and cost only what exceeds the compute. The disk tier's writes and reads
(memory.offload_disk_layers; `bytes:disk_write`, `bytes:disk_read` from the ledger) block the training thread:
on the critical path, bytes / disk bandwidth, prefetched or not. The optimizer states parked on the host
(memory.offload_optimizer_states; `bytes:optimizer_parking`, both directions) are copied before the forward and
after the backward, with nothing to hide behind: on the critical path at the host link's bandwidth. Not modelled: memory-bound element-wise work (norms,
RoPE, SwiGLU, softmax of the loss, accumulations: absorbed by the calibrated GEMM efficiency), the offload copies
to the host (on a side stream during the forward, which waits for none of them), the optimizer step,
kernel-efficiency loss of small per-stage calls (measured on an H200 at C = 1: 1.2% at U = 16 and 7.8% at U = 1 for
one Llama3-8B layer at 128K, docs/gpu_results.md).

The two efficiencies are calibrated (`calibrate`) on measured step times of one strategy (the paper's Ulysses
column, tools/step_time_report.py) and then used unchanged for the others.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

GEMMS = {"mm": (0, 1), "addmm": (1, 2), "addmm_": (1, 2), "bmm": (0, 1), "baddbmm": (1, 2), "baddbmm_": (1, 2)}
# sdpa-style kernels: query/key/value [b, h, N, d], keyword `is_causal`; backward ops are named *_backward
ATTENTION = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
COLLECTIVES = {  # op -> (kind, index of the input tensor(s), index of the process group)
    "alltoall_base_": ("alltoall", 1, 2), "_allgather_base_": ("allgather", 1, 2),
    "_reduce_scatter_base_": ("reduce_scatter", 1, 2), "allreduce_": ("allreduce", 0, 1),
    "allgather_into_tensor_coalesced_": ("allgather", 1, 2), "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1, 2),
    "send": ("send", 0, 1),
}
TP_KINDS = ("tp_allgather", "tp_reduce_scatter", "tp_allreduce")  # WorkCounter's kinds of the TP group
SEND_FRACTION = {"alltoall": lambda g: (g - 1) / g, "allgather": lambda g: g - 1,
                 "reduce_scatter": lambda g: (g - 1) / g, "allreduce": lambda g: 2 * (g - 1) / g, "send": lambda g: 1}


def causal_pairs(nq: int, nk: int) -> int:
    """(query, key) pairs a causal mask keeps (top-left aligned, as torch's SDPA): sum over rows of min(i + 1, nk)."""
    if nq <= nk:
        return nq * (nq + 1) // 2
    return nk * (nk + 1) // 2 + (nq - nk) * nk


def _named_args(func, args, kwargs) -> dict:
    names = [a.name for a in func._schema.arguments]
    return {**dict(zip(names, args)), **kwargs}


class WorkCounter:
    """Counts the work of the ops it is shown (`count`); `totals` is a flat dict of integers (extrapolated by depth
    like the memory terms): flops:gemm, flops:attention, calls:attention, bytes:<kind>:<link>, calls:<kind>:<link>."""

    def __init__(self, gpus_per_node: int = 8, tp_group: str | None = None) -> None:
        self.gpus_per_node = gpus_per_node
        self.tp_group = tp_group  # the tensor-parallel group's name: its collectives are counted as tp_<kind>
        self.totals: dict[str, int] = {}
        self._links: dict[str, str] = {}  # process group name -> link
        self._result: str | None = None  # "forward"/"backward": the next all-to-all carries a kernel's result

    def _add(self, key: str, n: float) -> None:
        self.totals[key] = self.totals.get(key, 0) + int(round(n))

    def count(self, func, args, kwargs) -> None:
        packet = getattr(func, "_overloadpacket", None)
        if packet is None:
            return
        name = packet.__name__
        if name in GEMMS:
            i, j = GEMMS[name]
            a, b = args[i], args[j]
            batch = math.prod(a.shape[:-2]) if a.dim() > 2 else 1
            self._add("flops:gemm", 2 * batch * a.shape[-2] * a.shape[-1] * b.shape[-1])
        elif name in ATTENTION or (name.endswith("_backward") and name[: -len("_backward")] in ATTENTION):
            a = _named_args(func, args, kwargs)
            self._attention(a["query"], a["key"], bool(a.get("is_causal")), name.endswith("_backward"))
        elif name == "attention_work" and func.namespace == "upipe_plan":  # a planning stand-in's call
            self._attention(*args[:4])
        elif name in COLLECTIVES and func.namespace == "c10d":
            kind, ti, gi = COLLECTIVES[name]
            group = torch.distributed.ProcessGroup.unbox(args[gi])
            g = group.size()
            if g <= 1:
                return
            link = self._link(group)
            tensors = args[ti] if isinstance(args[ti], (list, tuple)) else [args[ti]]
            sent = sum(t.numel() * t.element_size() for t in tensors) * SEND_FRACTION[kind](g)
            if group.group_name == self.tp_group:
                kind = f"tp_{kind}"
            self._add(f"bytes:{kind}:{link}", sent)
            self._add(f"calls:{kind}:{link}", 1)
            if kind == "alltoall" and self._result is not None:
                self._add(f"bytes:a2a_result_{self._result}:{link}", sent)
                self._add(f"calls:a2a_result_{self._result}:{link}", 1)
                self._result = None

    def _attention(self, q, k, causal: bool, backward: bool) -> None:
        b, h, nq, d = q.shape
        pairs = causal_pairs(nq, k.shape[2]) if causal else nq * k.shape[2]
        self._add("flops:attention", (10 if backward else 4) * b * h * d * pairs)
        self._add("calls:attention", 1)
        self._result = "backward" if backward else "forward"

    def _link(self, group) -> str:
        name = group.group_name
        if name not in self._links:
            ranks = torch.distributed.get_process_group_ranks(group)
            self._links[name] = "nvlink" if len({r // self.gpus_per_node for r in ranks}) == 1 else "ib"
        return self._links[name]


@dataclass(frozen=True)
class Hardware:
    """Stated constants of one GPU model in its usual node (the efficiencies are calibrated, see `calibrate`)."""

    name: str
    peak_flops: float  # dense bf16 FLOP/s per GPU, datasheet
    nvlink_bytes_per_s: float  # bytes one GPU sends per second in an all-to-all inside a node
    ib_bytes_per_s: float  # ... across nodes (its share of the node's InfiniBand)
    latency_s: float  # per collective call
    host_bytes_per_s: float  # host -> device bytes per second of one GPU from pinned memory (PCIe)
    disk_bytes_per_s: float = 3e9  # one GPU's share of the node's local NVMe volume, writing or reading
    gemm_efficiency: float = 0.6  # achieved / peak on the step's GEMMs (element-wise work absorbed)
    attention_efficiency: float = 0.6  # achieved / peak in the attention kernels
    source: str = ""


HARDWARE: dict[str, Hardware] = {h.name: h for h in (
    Hardware("h100-80gb", 989.4e12, 360e9, 45e9, 30e-6, 50e9, gemm_efficiency=0.395, attention_efficiency=0.643,
             source="H100 SXM5 datasheet: 989.4 TFLOP/s dense bf16; NVLink 4 450 GB/s per direction, of which NCCL's "
                    "all-to-all reaches about 80% (stated, not measured here); 8 x 400 Gb/s NDR InfiniBand per node "
                    "(50 GB/s per GPU, 90% reached); 30 us per collective call; PCIe Gen5 x16 64 GB/s per direction, "
                    "of which a pinned copy reaches about 80% (stated, not measured here); the local NVMe volume "
                    "(8 x 3.84 TB U.2, RAID-0) writes about 25 GB/s, 3 GB/s per GPU (stated from the drives' "
                    "sequential write, not measured; could be half that). Efficiencies fitted by "
                    "tools/step_time_report.py to the paper's Ulysses column (its FA3 kernel and stack; "
                    "examples/plans/step_time_llama3_8b_8xh100.json)"),
    Hardware("h200", 989.4e12, 360e9, 45e9, 30e-6, 50e9, gemm_efficiency=0.70, attention_efficiency=0.33,
             source="the H100's chip and links; efficiencies measured on the lent H200 with torch's SDPA flash "
                    "kernel (FA2) and no TE: GEMMs 684-704 TFLOP/s, one attention layer fwd+bwd 327 TFLOP/s "
                    "(docs/gpu_results.md)"),
)}


@dataclass(frozen=True)
class StepTime:
    seconds: float
    tokens_per_s_per_gpu: float
    parts: dict[str, float]  # seconds: gemm, attention, all-to-all (exposed), tensor-parallel collectives, sharding
    # collectives (exposed), p2p, offload copies back, disk tier, optimizer states parked

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def comm_seconds(work: dict[str, int], kinds: tuple[str, ...], hw: Hardware) -> float:
    """Time of the collectives of `kinds`: bytes over each link's bandwidth plus a latency per call."""
    t = 0.0
    for link, bw in (("nvlink", hw.nvlink_bytes_per_s), ("ib", hw.ib_bytes_per_s)):
        for kind in kinds:
            t += work.get(f"bytes:{kind}:{link}", 0) / bw + work.get(f"calls:{kind}:{link}", 0) * hw.latency_s
    return t


def host_seconds(work: dict[str, int], hw: Hardware) -> float:
    """Time of the offloaded layer inputs' copies back to the device."""
    return work.get("bytes:host_to_device", 0) / hw.host_bytes_per_s


def predict(work: dict[str, int], hw: Hardware, tokens_per_step: int, world_size: int, *, overlap_stages: int = 0,
            drained_stages: tuple[int, int] = (0, 0), ring_overlap: bool = False,
            offload_prefetch: bool = False) -> StepTime:
    """Seconds per training step and tokens/s per GPU from the counted `work` of rank 0 (every rank does the same
    work); `overlap_stages` = the number of UPipe stages per layer when memory.upipe_overlap=true pipelines them (0:
    the all-to-alls run serially); `drained_stages` = (stages, KV rounds) per layer when memory.upipe_overlap=outputs
    drains the results ((0, 0): not); `ring_overlap`: memory.ring_overlap, the ring's passes run during its blocks;
    `offload_prefetch`: memory.offload_prefetch, the offloaded inputs come back during the previous layer's
    backward."""
    gemm = work.get("flops:gemm", 0) / (hw.peak_flops * hw.gemm_efficiency)
    attention = work.get("flops:attention", 0) / (hw.peak_flops * hw.attention_efficiency)
    a2a = comm_seconds(work, ("alltoall",), hw)
    hidden = 0.0  # all-to-all seconds hidden under compute
    if overlap_stages > 1:  # one stage's share stays exposed; the rest hides under the attention kernels
        hidden = min(a2a * (overlap_stages - 1) / overlap_stages, attention)
    n, rounds = drained_stages
    if n > 1:  # the drained results hide under the next stage's projections
        hidden = min(comm_seconds(work, ("a2a_result_forward",), hw) * (n - 1) / n
                     + comm_seconds(work, ("a2a_result_backward",), hw) * (n - rounds) / n, gemm)
    a2a -= hidden
    tp = comm_seconds(work, TP_KINDS, hw)
    p2p = comm_seconds(work, ("send",), hw)
    if ring_overlap:
        p2p = max(0.0, p2p - attention)
    # the compute that covers all-to-alls does not cover the sharding collectives too (the same links carry both)
    sharding = max(0.0, comm_seconds(work, ("allgather", "reduce_scatter", "allreduce"), hw) - gemm - attention
                   + hidden)
    host = host_seconds(work, hw)
    if offload_prefetch:
        host = max(0.0, host - gemm - attention)
    disk = (work.get("bytes:disk_write", 0) + work.get("bytes:disk_read", 0)) / hw.disk_bytes_per_s
    parked = work.get("bytes:optimizer_parking", 0) / hw.host_bytes_per_s
    parts = {"gemm": gemm, "attention": attention, "all-to-all": a2a, "tensor-parallel collectives": tp,
             "sharding collectives": sharding, "p2p": p2p, "offload copies back": host, "disk tier": disk,
             "optimizer states parked": parked}
    seconds = sum(parts.values())
    return StepTime(seconds, tokens_per_step / seconds / world_size, parts)


def calibrate(samples: list[tuple[dict[str, int], float]], hw: Hardware) -> Hardware:
    """`hw` with gemm_efficiency and attention_efficiency fitted to measured step times: (work, seconds) pairs, least
    squares on the relative error of the compute time (measured seconds minus the modelled communication and
    offload copies back, which use the stated link constants; the samples' stacks do not prefetch): minimise
    sum_i ((G_i x + A_i y) / c_i - 1)^2 over x = 1/(peak·e_gemm), y = 1/(peak·e_attention)."""
    rows = []
    for work, seconds in samples:
        comm = comm_seconds(work, ("alltoall", "send", *TP_KINDS), hw) + host_seconds(work, hw)
        c = seconds - comm
        if c <= 0:
            raise ValueError(f"a measured step of {seconds:.3f} s is shorter than its modelled communication "
                             f"({comm:.3f} s): the link constants of {hw.name} are too pessimistic")
        rows.append((work.get("flops:gemm", 0) / c, work.get("flops:attention", 0) / c))
    sgg = sum(g * g for g, _ in rows)
    saa = sum(a * a for _, a in rows)
    sga = sum(g * a for g, a in rows)
    sg = sum(g for g, _ in rows)
    sa = sum(a for _, a in rows)
    det = sgg * saa - sga * sga
    if det <= 0:
        raise ValueError("the samples cannot separate GEMM from attention time: give lengths that differ")
    x = (sg * saa - sa * sga) / det
    y = (sa * sgg - sg * sga) / det
    if x <= 0 or y <= 0:
        raise ValueError(f"calibration gave a non-positive rate (x={x:.3g}, y={y:.3g}): the samples disagree with "
                         "the model")
    return dataclasses.replace(hw, gemm_efficiency=1 / (x * hw.peak_flops), attention_efficiency=1 / (y * hw.peak_flops))
